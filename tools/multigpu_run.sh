#!/usr/bin/env bash
# Issue 6 on a multi-GPU machine (device kinds nvidia-h200-x2 / -x4 / -x8), one device call:
#   equiv    N ranks vs 1 rank with gradient accumulation, each arm: the same first optimizer steps
#            (every stage: --steps 5 with 1 extension step), weights compared tensor by tensor
#            against the 1-rank run-to-run noise (a second 1-rank run), validation reduced over ranks;
#   bench    ms per optimizer step of the arms on N GPUs, interleaved (speedrun bench step under
#            torchrun), per stage in STAGES; BENCH_1GPU=1 adds the 1-GPU bench and the scaling
#            efficiency t1 / (N * tN);
#   compare  the same-node A/B: speedrun compare under torchrun, both arms x SEEDS seeds, the full
#            schedules (record 1285, candidate 1315 steps), checkpoints every CKPT_EVERY steps so the
#            same command on the still-warm machine resumes a run the call's time limit cut.
# Usage (repo root, .carry/ carried with the webmix shards):  bash tools/multigpu_run.sh [parts...]
# Env: NPROC (default: every GPU), ARMS (default "base=record cand=candidate"), STAGES (default 2),
#      SEEDS (4), EQUIV_STEPS (5), EQUIV_ACCUM (8: micro-batches per step on 1 rank, split over N), EQUIV_TOL (1e-2; EQUIV_VAL_TOL 1e-3), CKPT_EVERY (250), REC (records folder,
#      /tmp/mg/records), BUDGET_S (570), DEVICE (cuda; "cpu" runs a gloo smoke test: with
#      ARMS of the tiny-record preset and EXTRA shrinking it), EXTRA (more "--set k=v" for every run).
# Data: one 25M-token webmix train shard; a full record run reads ~339M tokens, i.e. every token
# ~13.5 times (say so next to any loss from it).  Validation: the 10,485,760-token webmix val shard.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-}
# NVLink multicast stays off (KINDS.md: it can take the host's shared GPUs out of service).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-$PWD/bench_out}
WORK=${WORK:-/tmp/mg}
mkdir -p "$OUT" "$WORK"
DEVICE=${DEVICE:-cuda}
if [ "$DEVICE" = cuda ]; then
  NPROC=${NPROC:-$(nvidia-smi -L | wc -l)}
  nvidia-smi --query-gpu=index,name,driver_version,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/gpus.txt"
  nvidia-smi topo -m > "$OUT/topology.txt" 2>&1
else
  NPROC=${NPROC:-2}
fi
ARMS=${ARMS:-base=record cand=candidate}
EXTRA=${EXTRA:-}
parts=${*:-"equiv bench"}
log() { echo "== $(date -u +%H:%M:%S) $*"; }
DEADLINE=$(( $(date +%s) + ${BUDGET_S:-570} ))
left() { local r=$(( DEADLINE - $(date +%s) - 5 )); [ "$r" -lt "$1" ] && echo $(( r > 1 ? r : 1 )) || echo "$1"; }

if [ -z "${SPEEDRUN_TEST_DATA:-}" ]; then
  export SPEEDRUN_TEST_DATA=/tmp/webmix
  mkdir -p "$SPEEDRUN_TEST_DATA"
  for f in .carry/webmix_*.bin.xz; do
    [ -e "$f" ] || { echo "no .carry/webmix_*.bin.xz and no SPEEDRUN_TEST_DATA" >&2; exit 2; }
    dst=$SPEEDRUN_TEST_DATA/$(basename "${f%.xz}")
    [ -s "$dst" ] || xz -dc "$f" > "$dst" &
  done
  wait
fi
DATA=(--data "$SPEEDRUN_TEST_DATA/webmix_train_*.bin" --val-data "$SPEEDRUN_TEST_DATA/webmix_val_*.bin")

# arm_args NAME=PRESET[:k=v,...] -> --preset PRESET --set k=v ... (overrides must not hold commas)
arm_args() {
  local rest=${1#*=}
  local preset=${rest%%:*}
  printf -- '--preset %s' "$preset"
  if [ "$rest" != "$preset" ]; then
    local kv
    IFS=',' read -ra kv <<< "${rest#*:}"
    printf -- ' --set %s' "${kv[@]}"
  fi
}
# launcher N: the command that runs speedrun in one process, or under torchrun with N ranks here
launcher() {
  if [ "$1" = 1 ]; then echo "python3 -m speedrun"
  else echo "python3 -m torch.distributed.run --standalone --nproc_per_node=$1 -m speedrun"; fi
}
extra_args() { local x; for x in $EXTRA; do printf -- '--set %s ' "$x"; done; }
run_dir() { ls -d "$1"/*/ 2>/dev/null | head -1; }

for part in $parts; do
  case $part in
    equiv)
      for arm in $ARMS; do
        name=${arm%%=*}
        log "equiv $name: 1 rank (twice: the noise floor) and $NPROC ranks, ${EQUIV_STEPS:-5} steps, eager"
        for tag in one one_again n$NPROC; do
          n=1; [ "$tag" = "n$NPROC" ] && n=$NPROC
          rm -rf "$WORK/eq-$name-$tag"
          # shellcheck disable=SC2046
          OMP_NUM_THREADS=4 timeout "$(left 300)" $(launcher $n) train $(arm_args "$arm") \
            --steps "${EQUIV_STEPS:-5}" --quiet --out "$WORK/eq-$name-$tag" --name eq \
            --set train.device="$DEVICE" --set train.num_extension=1 --set train.warmup_steps=0 \
            --set train.compile=false --set train.val_every=2 --set train.val_tokens="${EQUIV_VAL_TOKENS:-2097152}" \
            --set train.grad_accum=$(( ${EQUIV_ACCUM:-8} / n )) \
            --set train.max_docs=256 --set train.seed="${EQUIV_SEED:-7}" $(extra_args) "${DATA[@]}" 2>&1 | tail -3
        done
        one=$(run_dir "$WORK/eq-$name-one"); again=$(run_dir "$WORK/eq-$name-one_again"); many=$(run_dir "$WORK/eq-$name-n$NPROC")
        python3 tools/compare_runs.py "$one" "$again" --tolerance "${EQUIV_TOL:-1e-2}" --val-tolerance "${EQUIV_VAL_TOL:-1e-3}" \
          --json "$OUT/equiv_${name}_noise.json" | tee "$OUT/equiv_${name}_noise.txt"
        python3 tools/compare_runs.py "$one" "$many" --tolerance "${EQUIV_TOL:-1e-2}" --val-tolerance "${EQUIV_VAL_TOL:-1e-3}" \
          --json "$OUT/equiv_${name}_n$NPROC.json" | tee "$OUT/equiv_${name}_n$NPROC.txt"
        cp "$many/log.txt" "$OUT/equiv_${name}_n${NPROC}_log.txt" 2>/dev/null
      done ;;
    bench)
      arms=""; for a in $ARMS; do arms="$arms --arm $a"; done
      for stage in ${STAGES:-2}; do
        log "bench step on $NPROC GPUs, stage index $stage: $ARMS"
        # shellcheck disable=SC2046,SC2086
        timeout "$(left 560)" $(launcher $NPROC) bench step $arms --stage "$stage" --steps 20 --warmup 3 \
          --set train.max_docs=256 --set train.device="$DEVICE" $(extra_args) "${DATA[@]:0:2}" \
          --json "$OUT/bench_n${NPROC}_stage$stage.json" 2>&1 | tail -10
        if [ "${BENCH_1GPU:-0}" = 1 ]; then
          log "bench step on 1 GPU, stage index $stage"
          # shellcheck disable=SC2046,SC2086
          timeout "$(left 560)" $(launcher 1) bench step $arms --stage "$stage" --steps 20 --warmup 3 \
            --set train.max_docs=256 --set train.device="$DEVICE" $(extra_args) "${DATA[@]:0:2}" \
            --json "$OUT/bench_n1_stage$stage.json" 2>&1 | tail -8
          [ -s "$OUT/bench_n1_stage$stage.json" ] && [ -s "$OUT/bench_n${NPROC}_stage$stage.json" ] && \
          python3 - "$OUT/bench_n1_stage$stage.json" "$OUT/bench_n${NPROC}_stage$stage.json" "$NPROC" <<'EOF'
import json, sys
one, many, n = json.load(open(sys.argv[1])), json.load(open(sys.argv[2])), int(sys.argv[3])
t1 = {a["name"]: a["median_ms"] for a in one["arms"]}
for a in many["arms"]:
    print(f"{a['name']}: 1 GPU {t1[a['name']]:.1f} ms, {n} GPUs {a['median_ms']:.1f} ms per step, "
          f"scaling efficiency {t1[a['name']] / (n * a['median_ms']):.3f}")
EOF
        fi
      done ;;
    compare)
      REC=${REC:-$WORK/records}
      arms=""; for a in $ARMS; do arms="$arms --arm $a"; done
      log "compare on $NPROC GPUs: $ARMS x ${SEEDS:-4} seeds, full schedules, records in $REC"
      # shellcheck disable=SC2046,SC2086
      timeout "$(left 580)" $(launcher $NPROC) compare $arms --seeds "${SEEDS:-4}" --out "$REC" --quiet \
        --set train.checkpoint_every="${CKPT_EVERY:-250}" --set train.max_docs=256 --set train.device="$DEVICE" \
        $(extra_args) "${DATA[@]}" 2>&1 | tail -20
      mkdir -p "$OUT/records"
      cp "$REC"/README.md "$REC"/results.json "$REC"/manifest.json "$REC"/*.png "$OUT/records/" 2>/dev/null
      for d in "$REC"/runs/*/; do cp "$d/log.txt" "$OUT/records/$(basename "$d").log.txt" 2>/dev/null; done
      head -40 "$REC/README.md" 2>/dev/null ;;
    *) echo "unknown part $part (equiv bench compare)" >&2; exit 2 ;;
  esac
done
log done
