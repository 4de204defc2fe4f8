#!/usr/bin/env bash
# One device call: GPU tests, doctor, benchmarks and a short GPU training, results under $OUT.
# Usage (on the GPU machine, repo root):  bash benchmarks/device_run.sh [parts...]
# parts: tests doctor attention kernels train record (default: all but record).  Webmix shards (.xz) are read from
# .carry/ when present.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-}
OUT=${OUT:-$PWD/bench_out}
mkdir -p "$OUT"
parts=${*:-"tests doctor attention kernels train"}
log() { echo "== $(date -u +%H:%M:%S) $*"; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total --format=csv | tee "$OUT/gpu.txt"
if [ -d .carry ] && ls .carry/*.xz >/dev/null 2>&1; then
  mkdir -p /tmp/webmix
  for f in .carry/*.xz; do xz -dc "$f" > /tmp/webmix/$(basename "${f%.xz}") & done; wait
  export SPEEDRUN_TEST_DATA=/tmp/webmix
fi
[ -d .carry/gpt2 ] && export SPEEDRUN_TOKENIZER_DIR=$PWD/.carry/gpt2
for part in $parts; do
  case $part in
    tests)
      log "GPU tests"
      timeout 400 python3 -m pytest -q -m gpu tests 2>&1 | tail -25 | tee "$OUT/gpu_tests.txt" ;;
    doctor)
      log doctor
      timeout 120 python3 -m speedrun doctor 2>&1 | tail -30 | tee "$OUT/doctor.txt" ;;
    attention)
      log "attention backends, stage-3 shapes"
      timeout 300 python3 benchmarks/bench_attention.py --reps 3 2>&1 | tail -20 ;;
    kernels)
      for b in bench_polar_express bench_cross_entropy bench_mlp bench_qk_prep; do
        log "$b"; timeout 200 python3 benchmarks/$b.py 2>&1 | tail -25
      done ;;
    train)
      log "short GPU training on webmix (small preset, 150 steps)"
      timeout 400 python3 -m speedrun train --preset small --steps 150 --out /tmp/runs \
        --data "$SPEEDRUN_TEST_DATA/webmix_train_*.bin" --val-data "$SPEEDRUN_TEST_DATA/webmix_val_*.bin" \
        --set train.val_every=50 --set train.log_every=25 --set train.val_tokens=1048576 \
        --set train.batch_tokens=65536 2>&1 | tail -20
      cp /tmp/runs/*/log.txt "$OUT/small_webmix_log.txt" 2>/dev/null ;;
    record)
      log "record vs candidate: one optimizer step per stage, interleaved (bench step)"
      for stage in 0 1 2; do
        timeout 550 python3 -m speedrun bench step --arm base=record --arm cand=candidate --stage $stage \
          --steps 20 --warmup 3 --set train.max_docs=256 \
          --data "$SPEEDRUN_TEST_DATA/webmix_train_*.bin" --json "$OUT/bench_step_stage$stage.json" 2>&1 | tail -12
      done ;;
  esac
done
log done
