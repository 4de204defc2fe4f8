#!/usr/bin/env bash
# One device call: GPU tests, doctor, benchmarks and a short GPU training, results under $OUT.
# Usage (on the GPU machine, repo root):  bash tools/device_run.sh [parts...]
# parts: tests doctor attention kernels train record profile ncu abloss recordrun candrun fullrun
# (default: the first five).
# Webmix shards (.xz) are read from .carry/ when present (a fresh checkout fills .carry/ and .whl/ with
# tools/carry_prepare.sh).  BUDGET_S (default 570) bounds the whole
# call: each part's timeout is cut to what is left of it, so a hung part cannot eat the call.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-}
OUT=${OUT:-$PWD/bench_out}
mkdir -p "$OUT"
parts=${*:-"tests doctor attention kernels train"}
log() { echo "== $(date -u +%H:%M:%S) $*"; }
DEADLINE=$(( $(date +%s) + ${BUDGET_S:-570} ))
# left CAP: seconds this part may take, at most CAP and at most what is left of the budget
left() { local r=$(( DEADLINE - $(date +%s) - 5 )); [ "$r" -lt "$1" ] && echo $(( r > 1 ? r : 1 )) || echo "$1"; }
# short_run PRESET: the preset's full model and recipe on a shortened schedule (35 steps in each of the
# three stages + 35 extension steps, so each has >= 30 timed steps after the first few), full
# 10,485,760-token validation, log into $OUT.  SHORT_STEPS / SHORT_EXT (default 140 / 35) change
# the schedule, e.g. 47 / 2 to time the same steps as `upstream_f411b3d.sh --scheduled 45
# --extension 2` (then: python3 tools/upstream_step_times.py $OUT/record_short_log.txt --scheduled 45).
# SHORT_SET: extra overrides, space-separated (e.g. "model.mlp_input_quant=graph").
short_run() {
  local steps=${SHORT_STEPS:-140} ext=${SHORT_EXT:-35} kv kvs sets=()
  read -ra kvs <<< "${SHORT_SET:-}"  # split at spaces, no glob expansion (an override may hold a '*')
  for kv in ${kvs[@]+"${kvs[@]}"}; do sets+=(--set "$kv"); done
  log "$1 preset, shortened schedule ($((steps - ext)) + $ext steps) on webmix"
  timeout "$(left "$2")" python3 -m speedrun train --preset "$1" --steps "$steps" --set train.num_extension="$ext" \
    --out /tmp/runs --name "$1-short" --data "$SPEEDRUN_TEST_DATA/webmix_train_*.bin" \
    --val-data "$SPEEDRUN_TEST_DATA/webmix_val_*.bin" --set train.max_docs=256 ${sets[@]+"${sets[@]}"} --quiet 2>&1 | tail -30
  cp /tmp/runs/"$1"-short-*/log.txt "$OUT/$1_short_log.txt" 2>/dev/null
  grep -E "warmup|stage [0-9]|val_loss|compilations|peak" "$OUT/$1_short_log.txt" 2>/dev/null | grep -v "^step:[0-9]*/[0-9]* train_time" | tail -12
  # the same steps of both, stage by stage (meaningful when the schedules match: SHORT_STEPS=47
  # SHORT_EXT=2 against upstream_f411b3d.sh --scheduled 45 --extension 2)
  vs_upstream "$OUT/$1_short_log.txt" 8
}
# vs_upstream OURS ROWS: when upstream ran on this machine (upstream_f411b3d.sh, UP_DIR), OURS (a
# bench JSON or our training log) against upstream's log: upstream_step_times.py's comparison table
vs_upstream() {
  local uplog; uplog=$(ls -t "${UP_DIR:-/tmp/up}"/logs/*.txt 2>/dev/null | head -1)
  [ -n "$uplog" ] && [ -e "$1" ] || return 0
  python3 tools/upstream_step_times.py "$uplog" --config "${UP_DIR:-/tmp/up}/bench_config.json" \
    --ours "$1" 2>&1 | grep -A"$2" "^ours "
}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total --format=csv | tee "$OUT/gpu.txt"
if [ -d .carry ] && ls .carry/*.xz >/dev/null 2>&1; then
  mkdir -p /tmp/webmix
  for f in .carry/*.xz; do xz -dc "$f" > /tmp/webmix/$(basename "${f%.xz}") & done; wait
  export SPEEDRUN_TEST_DATA=/tmp/webmix
fi
[ -d .carry/gpt2 ] && export SPEEDRUN_TOKENIZER_DIR=$PWD/.carry/gpt2
# optional packages carried as wheels (.whl/, git-ignored), e.g. nvidia-cudnn-frontend for the cudnn backend
# (not again where an earlier part or an upstream run on its cuDNN shim installed them: a reinstall
# would replace files a running process imports)
if ls .whl/*.whl >/dev/null 2>&1; then
  [ -d /tmp/site/cudnn ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
  [ -d /tmp/site ] && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
# FA4 and the CuTe DSL, where tools/fa4_carry.sh installed them in an earlier call on this machine
[ -d "${FA4_SITE:-/tmp/fa4site}" ] && export PYTHONPATH=$PYTHONPATH:${FA4_SITE:-/tmp/fa4site}:${FA4_SITE:-/tmp/fa4site}/nvidia_cutlass_dsl/dsl_packages
for part in $parts; do
  case $part in
    tests)
      log "GPU tests"
      # TESTS_PATHS: which test files or folders (default: all of tests/); TESTS_ARGS: extra pytest arguments
      # (split at spaces); TESTS_K: a -k expression, passed whole ("a or b")
      # (the whole output goes to gpu_tests.txt, one line per test as it ends, so a part cut by its
      # time limit still names what passed; the call's screen gets its last 25 lines)
      timeout "$(left ${TESTS_S:-400})" python3 -m pytest -v -m gpu ${TESTS_PATHS:-tests} ${TESTS_ARGS:-} \
        ${TESTS_K:+-k "$TESTS_K"} > "$OUT/gpu_tests.txt" 2>&1
      tail -25 "$OUT/gpu_tests.txt" ;;
    doctor)
      log doctor
      timeout "$(left 240)" python3 -m speedrun doctor 2>&1 | tail -30 | tee "$OUT/doctor.txt" ;;
    attention)
      log "attention backends, stage-3 shapes"
      timeout "$(left 300)" python3 benchmarks/bench_attention.py --reps 5 \
        ${SPEEDRUN_TEST_DATA:+--data "$SPEEDRUN_TEST_DATA/webmix_train_*.bin"} 2>&1 | tail -60 ;;
    kernels)
      # BENCHES: names, each optionally with its arguments after a colon, comma-separated
      # (e.g. "bench_adam bench_cross_entropy:--sweep,--skip-eager")
      for entry in ${BENCHES:-bench_host bench_rotary bench_polar_express bench_cross_entropy bench_mlp bench_qk_prep bench_adam}; do
        b=${entry%%:*}; bargs=""; [ "$entry" != "$b" ] && bargs=${entry#*:} && bargs=${bargs//,/ }
        log "$b $bargs"; timeout "$(left 200)" python3 benchmarks/$b.py $bargs 2>&1 | tail -40
      done ;;
    train)
      log "short GPU training on webmix (small preset, 150 steps)"
      timeout 400 python3 -m speedrun train --preset small --steps 150 --out /tmp/runs \
        --data "$SPEEDRUN_TEST_DATA/webmix_train_*.bin" --val-data "$SPEEDRUN_TEST_DATA/webmix_val_*.bin" \
        --set train.val_every=50 --set train.log_every=25 --set train.val_tokens=1048576 \
        --set train.batch_tokens=65536 2>&1 | tail -20
      cp /tmp/runs/*/log.txt "$OUT/small_webmix_log.txt" 2>/dev/null ;;
    record)
      # BENCH_ARMS: space-separated NAME=PRESET[:overrides], e.g. add
      # "candfwd=candidate:model.kernels=fp8_fwd" (the candidate with the record's MLP precision).
      # BENCH_STEPS: timed steps per arm (default 20; host-bound stage-1 steps need more).
      # HOST_STEPS (default 5): steps per arm traced phase by phase (host, GPU, lead); SYNC_SCAN=0 skips the scan.
      # CHAIN (default 1): steps back to back per timed sample (--chain; >1 is comparable with upstream's
      # logs; "1,3" times every arm both ways in the same rounds, paired).
      # AS_RANK_OF=N: every arm runs rank 0's share of an N-GPU step (--as-rank-of; collectives as
      # no-ops), files bench_step_rankN_stageS.json, projected as an N-GPU run.
      BENCH_ARMS=${BENCH_ARMS:-base=record cand=candidate}
      log "bench step, interleaved: $BENCH_ARMS"
      arms=""; for a in $BENCH_ARMS; do arms="$arms --arm $a"; done
      for stage in ${STAGES:-0 1 2}; do
        timeout "$(left 550)" python3 -m speedrun bench step $arms --stage $stage \
          --steps "${BENCH_STEPS:-20}" --warmup 3 --set train.max_docs=256 --host-steps "${HOST_STEPS:-5}" --chain "${CHAIN:-1}" \
          $([ "${SYNC_SCAN:-1}" = 1 ] && echo --sync-scan) ${AS_RANK_OF:+--as-rank-of $AS_RANK_OF} \
          --data "$SPEEDRUN_TEST_DATA/webmix_train_*.bin" \
          --json "$OUT/bench_step${AS_RANK_OF:+_rank$AS_RANK_OF}_stage$stage.json" 2>&1 | tail -30
      done  # (the bench samples each arm's SM clock and power itself: its table's "GPU clocks")
      # every stage benched: each arm's whole-run time from its own schedule
      # (with upstream's run on this machine, UP_DIR, as the first arm and baseline: UP_NAME on
      # the schedule of UP_PRESET, default f411b3d on the record's; PR #344: UP_DIR=/tmp/up344
      # UP_NAME=pr344 UP_PRESET=candidate)
      set -- "$OUT"/bench_step${AS_RANK_OF:+_rank$AS_RANK_OF}_stage*.json
      up_args=()
      uplog=$(ls -t "${UP_DIR:-/tmp/up}"/logs/*.txt 2>/dev/null | head -1)
      if [ -z "${AS_RANK_OF:-}" ] && [ -n "$uplog" ] && python3 tools/upstream_step_times.py "$uplog" \
          --config "${UP_DIR:-/tmp/up}/bench_config.json" --json "$OUT/upstream_steps.json" > /dev/null 2>&1; then
        up_args=(--upstream "${UP_NAME:-f411b3d}=$OUT/upstream_steps.json:${UP_PRESET:-record}")
      fi
      # LINK_GBPS (a simulated rank only): also the run with its collectives at that bus bandwidth
      [ "$#" -ge 3 ] && python3 -m speedrun bench project "$@" ${up_args[@]+"${up_args[@]}"} \
        ${AS_RANK_OF:+${LINK_GBPS:+--link-gbps $LINK_GBPS}} \
        --json "$OUT/projection${AS_RANK_OF:+_rank$AS_RANK_OF}.json" 2>&1 | tail -24
      # every arm / upstream per benched stage, when upstream ran on this machine (one GPU's whole
      # step, so not for a simulated rank)
      if [ -z "${AS_RANK_OF:-}" ]; then for f in "$@"; do vs_upstream "$f" 20; done; fi ;;
    profile)
      # PROFILE_ARMS: arms NAME=PRESET[:overrides] or presets; PROFILE_STAGE: the stage index whose
      # shapes are profiled (default 2); PROFILE_WARMUP: untimed steps first (default 2; with CUDA graphs
      # `speedrun profile` adds what capture needs, so the profiled steps replay); PROFILE_DEVICE_ONLY=1: GPU activity alone (the timeline's
      # idle gaps near an unprofiled step's, no op rows) instead of ops with shapes and Python
      # stacks.  With two or more arms, every later arm is diffed against the first, kernel by
      # kernel (e.g. PROFILE_ARMS="e=record:train.cuda_graphs=off g=record" PROFILE_DEVICE_ONLY=1).
      first=""
      for arm in ${PROFILE_ARMS:-record candidate}; do
        name=${arm%%=*}
        log "profile $arm at stage index ${PROFILE_STAGE:-2} (2: stage-3 shapes), ${PROFILE_STEPS:-2} steps"
        pflags="--stacks"; [ "${PROFILE_DEVICE_ONLY:-0}" = 1 ] && pflags="--device-only --no-measure"
        timeout "$(left 300)" python3 -m speedrun profile --arm "$arm" --stage "${PROFILE_STAGE:-2}" \
          --steps "${PROFILE_STEPS:-2}" --warmup "${PROFILE_WARMUP:-2}" $pflags \
          --set train.max_docs=256 --data "$SPEEDRUN_TEST_DATA/webmix_train_*.bin" --out "/tmp/prof_$name" --top 25 2>&1 | tail -45
        cp "/tmp/prof_$name/profile.md" "$OUT/profile_${name}_stage${PROFILE_STAGE:-2}.md" 2>/dev/null
        cp "/tmp/prof_$name/profile.json" "$OUT/profile_${name}_stage${PROFILE_STAGE:-2}.json" 2>/dev/null
        if [ -z "$first" ]; then
          first=$name
        else
          python3 -m speedrun profile --diff "/tmp/prof_$first" "/tmp/prof_$name" --top 40 \
            --json "$OUT/profile_diff_${name}_vs_${first}.json" > "$OUT/profile_diff_${name}_vs_${first}.md" 2>&1
          head -20 "$OUT/profile_diff_${name}_vs_${first}.md"
        fi
        # the generated source of the slowest Inductor kernels, to read why they are slow (one
        # file: the device tool brings back only a few files per folder)
        python3 tools/inductor_sources.py "/tmp/prof_$name/profile.json" --top "${INDUCTOR_TOP:-8}" \
          --out "/tmp/inductor_$name" 2>&1 | tail -12
        cat /tmp/inductor_"$name"/*.py > "$OUT/inductor_$name.txt" 2>/dev/null
      done ;;
    ncu)
      # Measured DRAM bytes of our own Triton kernels (NCU_KERNELS regex) in one record step at stage
      # 0 (the child process replays each profiled launch; all ~7,000 of a step take too long).
      NCU_KERNELS=${NCU_KERNELS:-_relu2|_dual_layout|_abs_max|_ce_fwd|_transpose_bytes|_qk_prep|_pack_kernel|_xxt|_xtx|_ba_plus}
      log "profile --ncu, ${NCU_ARM:-record}, kernels matching $NCU_KERNELS"
      timeout "$(left 450)" python3 -m speedrun profile --arm "${NCU_ARM:-record}" --stage 0 --steps 1 --warmup 1 \
        --ncu --ncu-kernels "$NCU_KERNELS" --ncu-launches "${NCU_LAUNCHES:-600}" --ncu-timeout "$(( $(left 450) - 30 ))" \
        --set train.max_docs=256 --data "$SPEEDRUN_TEST_DATA/webmix_train_*.bin" --out /tmp/prof_ncu --top 25 2>&1 | tail -40
      cp /tmp/prof_ncu/profile.md "$OUT/profile_ncu.md" 2>/dev/null; cp /tmp/prof_ncu/profile.json "$OUT/profile_ncu.json" 2>/dev/null ;;
    abloss)
      # AB_SEEDS: a list "0,1,2" (distinct seeds); AB_ARMS: space-separated NAME=PRESET[:overrides].
      # Default: the preset's step relation, shortened: the record trains 1285 steps and the
      # candidate 1315 (+2.3%), so here 135 and 138.  "cand=candidate" alone measures the per-step
      # loss cost at equal steps.  Eager runs are launch-bound (0.7-0.9 s/step at any batch, the GPU
      # mostly idle), so every (arm, seed) run is its own process and AB_JOBS (default 3) of them
      # share the GPU at once; their times are not speed measurements, only the losses count.  An
      # eager process at batch/4 holds 20-26 GiB: six at once ran the H200 out of memory.
      AB_ARMS=${AB_ARMS:-base=record cand=candidate:train.steps=138,train.num_extension=33}
      AB_SEEDS=${AB_SEEDS:-0,1,2}
      # AB_SET: the overrides every arm gets (default: shortened eager schedule, batches / 4; an eager
      # process holds ~19 GiB at batches / 8, where six at once fit)
      AB_SET=${AB_SET:-train.compile=false train.batch_divisor=4 train.steps=135 train.num_extension=30 train.max_docs=256}
      log "loss A/B: $AB_ARMS, seeds $AB_SEEDS, ${AB_JOBS:-3} at once, every arm with: $AB_SET"
      ab_sets=""; for kv in $AB_SET; do ab_sets="$ab_sets --set $kv"; done
      rm -rf /tmp/ab; mkdir -p /tmp/ab "$OUT/ab"
      ab_end=$(( $(date +%s) + $(left 580) ))
      for s in ${AB_SEEDS//,/ }; do
        for a in $AB_ARMS; do
          while [ "$(jobs -rp | wc -l)" -ge "${AB_JOBS:-3}" ]; do sleep 5; done
          OMP_NUM_THREADS=2 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout $(( ab_end - $(date +%s) )) python3 -m speedrun compare --arm "$a" \
            --seeds 1 --base-seed "$s" --out "/tmp/ab/${a%%=*}-s$s" --quiet --no-measure $ab_sets --data "$SPEEDRUN_TEST_DATA/webmix_train_*.bin" \
            --val-data "$SPEEDRUN_TEST_DATA/webmix_val_*.bin" > "/tmp/ab/${a%%=*}-s$s.out" 2>&1 &
        done
      done
      ticks=0
      while [ -n "$(jobs -rp)" ]; do
        sleep 5; ticks=$(( ticks + 1 ))
        [ "$ticks" -eq 18 ] && nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader
        [ $(( ticks % 12 )) -ne 0 ] && continue
        for f in /tmp/ab/*/runs/*/log.txt; do
          echo "   $(basename "$(dirname "$f")"): $(grep -o '^step:[0-9]*/[0-9]*' "$f" | tail -1)"
        done
      done
      for f in /tmp/ab/*.out; do echo "-- $(basename "$f")"; tail -3 "$f"; done
      n_ok=$(ls /tmp/ab/*/runs/*/summary.json 2>/dev/null | wc -l); n_all=$(ls /tmp/ab/*.out | wc -l)
      log "loss A/B: $n_ok of $n_all runs finished$([ "$n_ok" -lt "$n_all" ] && echo ' (FAILED RUNS ABOVE)')"
      for d in /tmp/ab/*/runs/*/; do cp "$d/log.txt" "$OUT/ab/$(basename "$(dirname "$(dirname "$d")")").log.txt" 2>/dev/null; done
      groups=""; labels=""
      for a in $AB_ARMS; do groups="$groups /tmp/ab/${a%%=*}-s*/runs/*/log.txt"; labels="$labels,${a%%=*}"; done
      # unquoted on purpose: stats gets one glob per arm, expanded by itself (set -f keeps bash out)
      set -f; python3 -m speedrun stats $groups --labels "${labels#,}" --json "$OUT/ab/stats.json" 2>&1 \
        | tee "$OUT/ab/stats.md" | head -60; set +f ;;
    recordrun) short_run record 570 ;;
    candrun) short_run candidate 570 ;;
    fullrun)
      # The full-length schedule (record: 1285 steps, ~5 min of compile + ~13 min of training on one
      # H200) outlives one 10-minute call: it runs in its own session, and the same part in the next
      # call (machine still warm, i.e. called again within the idle release) waits for that run
      # instead of starting another.  FULL_PRESET (default record), FULL_SET (extra --set values,
      # space-separated), FULL_DIR (default /tmp/fullrun; rm -rf it to start over).
      FD=${FULL_DIR:-/tmp/fullrun}; FP=${FULL_PRESET:-record}
      if [ ! -e "$FD/started" ]; then
        mkdir -p "$FD"; touch "$FD/started"
        sets="--set train.max_docs=256"; for kv in ${FULL_SET:-}; do sets="$sets --set $kv"; done
        log "full-length $FP run started in $FD"
        (cd "$PWD" && setsid nohup bash -c "python3 -m speedrun train --preset $FP --out $FD/runs --name $FP-full \
            --data '$SPEEDRUN_TEST_DATA/webmix_train_*.bin' --val-data '$SPEEDRUN_TEST_DATA/webmix_val_*.bin' \
            $sets --quiet > $FD/stdout.txt 2>&1; echo \$? > $FD/rc" &) < /dev/null > /dev/null 2>&1  # (see upstream_f411b3d.sh)
      else
        log "full-length run in $FD started earlier: waiting for it"
      fi
      end=$(( $(date +%s) + $(left ${WAIT_S:-560}) ))
      while [ ! -e "$FD/rc" ] && [ "$(date +%s)" -lt "$end" ]; do sleep 10; done
      logf=$(ls -t "$FD"/runs/*/log.txt 2>/dev/null | head -1)
      [ -n "$logf" ] && cp "$logf" "$OUT/${FP}_full_log.txt" && grep -v "train_time" "$logf" | tail -15
      [ -n "$logf" ] && tail -2 "$logf"
      if [ -e "$FD/rc" ]; then log "full-length run finished, exit status $(cat "$FD/rc")"; tail -20 "$FD/stdout.txt"
      else log "full-length run still going: call this part again (within the idle release) to keep waiting"; fi ;;
  esac
done
# How large this machine's torch.compile cache has grown (what carrying it to the next session,
# as tools/compile_cache.py does for upstream's runs, would cost)
for d in /tmp/torchinductor_*; do [ -d "$d" ] && log "compile cache $d: $(du -sh "$d" | cut -f1)"; done
# The device tool brings back at most 8 files: more than that travel as one archive.
if [ "$(find "$OUT" -type f | wc -l)" -gt 8 ]; then
  (cd "$OUT" && tar czf /tmp/all_outputs.tgz . && find . -mindepth 1 -delete && mv /tmp/all_outputs.tgz .)
  log "outputs packed into all_outputs.tgz (more than 8 files)"
fi
log done
