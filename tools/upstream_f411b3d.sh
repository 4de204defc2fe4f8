#!/usr/bin/env bash
# Run upstream modded-nanogpt f411b3d (patched by upstream_f411b3d.py) on one GPU for a short
# schedule, or keep waiting for a run this script started earlier; results go to $OUT.
#
# On the GPU machine, repo root as cwd, `.carry` carried:   bash tools/upstream_f411b3d.sh [patcher args]
#   .carry/webmix_{train,val}_000000.bin.xz   webmix shards (decompressed to $DATA_DIR)
#   .carry/upstream/{train_gpt,triton_kernels,dc_triton_kernels}.py and .carry/upstream/tiktoken_cache/
# The training runs in its own session (setsid), so it survives the end of the call: if it is not
# done after WAIT_S seconds (torch.compile alone takes minutes), run the same command again on the
# still-warm machine and it waits for that run instead of starting another (rm -rf /tmp/up to start over).
# Writes to $OUT: upstream_patch.txt, upstream_stdout.txt, upstream_log.txt (logs/<uuid>.txt),
# bench_config.json, upstream_steps.json (median ms per optimizer step per stage), and
# upstream_clocks.csv + upstream_stage_marks.txt (SM clock and power per stage: gpu_clocks.py).
# The same script runs upstream PR #344 (tools/upstream_pr344.sh sets the three variables below).
# Compile cache (tools/compile_cache.py): the run compiles into /tmp/inductor_<UP's name>, first
# filled from .carry/compile_cache/<UP's name>.compile_cache.tar.gz where one was carried; with
# UP_CACHE_OUT=DIR a finished run's cache is saved there under that name (if it packs into 15 MiB),
# to carry to the next session.
set -u
R=$(pwd)
OUT=${OUT:-$R/bench_out}
UP=${UP_DIR:-/tmp/up}
PATCHER=${PATCHER:-$R/tools/upstream_f411b3d.py}   # which patcher (which upstream commit)
UP_SRC=${UP_SRC:-$R/.carry/upstream}                    # that commit's three files
TIKTOKEN_DIR=${TIKTOKEN_DIR:-$R/.carry/upstream/tiktoken_cache}
DATA=${DATA_DIR:-/tmp/webmix}
WAIT_S=${WAIT_S:-540}
UP_NAME_=$(basename "$UP")
CACHE_DIR=/tmp/inductor_$UP_NAME_
CACHE_FILE=$UP_NAME_.compile_cache.tar.gz
mkdir -p "$OUT"
log() { echo "== $(date -u +%H:%M:%S) $*"; }
# Which kernel answers upstream's FA3 calls (fa3_shim.py): varlen (torch's, the default), cudnn or
# fa4 (speedrun's backends: the repository and the carried wheels go on PYTHONPATH; fa4's packages
# where tools/fa4_carry.sh installed them).
# Use another UP_DIR per backend, e.g. UP_DIR=/tmp/upc SPEEDRUN_SHIM_BACKEND=cudnn.
export SPEEDRUN_SHIM_BACKEND=${SPEEDRUN_SHIM_BACKEND:-varlen}
if [ "$SPEEDRUN_SHIM_BACKEND" != varlen ]; then
  if ls "$R"/.whl/*.whl > /dev/null 2>&1 && [ ! -d /tmp/site/cudnn ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site "$R"/.whl/*.whl
  fi
  export PYTHONPATH=$R:/tmp/site:${PYTHONPATH:-}
  fa4site=${FA4_SITE:-/tmp/fa4site}
  [ -d "$fa4site" ] && export PYTHONPATH=$PYTHONPATH:$fa4site:$fa4site/nvidia_cutlass_dsl/dsl_packages
fi

decompress() {  # python's lzma: no dependence on the xz tool being installed
  mkdir -p "$DATA"
  for f in "$R"/.carry/webmix_*.bin.xz; do
    [ -e "$f" ] || { echo "no .carry/webmix_*.bin.xz" >&2; return 1; }
    dst=$DATA/$(basename "${f%.xz}")
    [ -s "$dst" ] || python3 -c 'import lzma,shutil,sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' "$f" "$dst" &
  done
  wait
}

start_run() {
  # upstream calls tiktoken.get_encoding("gpt2"), which downloads unless its cache is there
  ls "$TIKTOKEN_DIR"/* > /dev/null 2>&1 || { echo "no tiktoken cache in $TIKTOKEN_DIR:" \
    "copy ../shared/tokenizer/tiktoken_cache/ there (the GPU machine has no network)" >&2; return 1; }
  decompress || return 1
  python3 "$PATCHER" --src "$UP_SRC" --out "$UP" \
    --train-files "$DATA/webmix_train_*.bin" --val-files "$DATA/webmix_val_*.bin" "$@" | tee "$OUT/upstream_patch.txt"
  [ "${PIPESTATUS[0]}" = 0 ] || return 1
  touch "$UP/started"
  echo "$SPEEDRUN_SHIM_BACKEND" > "$UP/attention_backend.txt"
  rm -rf "$CACHE_DIR"
  python3 "$R/tools/compile_cache.py" restore "$R/.carry/compile_cache/$CACHE_FILE" "$CACHE_DIR" | tee "$UP/compile_cache.txt"
  # setsid: a new session outlives the device call; torch.distributed.run == torchrun.  The SM
  # clock and power log runs as long as the training (stage_marks.txt splits it by stage).  The
  # redirections close the whole backgrounded list (the subshell that runs `cd && setsid ...`
  # lives as long as the training): left on the caller's stdout, a caller reading it through a
  # pipe (`... | tail`) would wait for the whole run.
  (cd "$UP" && TIKTOKEN_CACHE_DIR="$TIKTOKEN_DIR" TORCHINDUCTOR_CACHE_DIR="$CACHE_DIR" PYTHONUNBUFFERED=1 setsid nohup bash -c \
     'nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu --format=csv,noheader -lms 250 \
        > clocks.csv 2>&1 & L=$!
      python3 -m torch.distributed.run --standalone --nproc_per_node=1 train_gpt.py > stdout.txt 2>&1; echo $? > rc
      kill $L' &) < /dev/null > /dev/null 2>&1
  log "started upstream in $UP (attention: $SPEEDRUN_SHIM_BACKEND)"
}

collect() {
  cp "$UP/stdout.txt" "$OUT/upstream_stdout.txt" 2>/dev/null
  cp "$UP/bench_config.json" "$OUT/" 2>/dev/null
  cp "$UP/attention_backend.txt" "$OUT/upstream_attention_backend.txt" 2>/dev/null
  cp "$UP/compile_cache.txt" "$OUT/upstream_compile_cache.txt" 2>/dev/null
  cp "$UP/upstream_kernels.json" "$OUT/" 2>/dev/null  # with --profile START:COUNT
  if [ -e "$UP/upstream_kernels.json" ]; then  # the source of its slowest Inductor kernels (same cache)
    python3 "$R/tools/inductor_sources.py" "$UP/upstream_kernels.json" --top "${INDUCTOR_TOP:-12}" \
      --out /tmp/inductor_upstream > /dev/null 2>&1 && cat /tmp/inductor_upstream/*.py > "$OUT/inductor_upstream.txt"
  fi
  if [ -s "$UP/stage_marks.txt" ] && [ -s "$UP/clocks.csv" ]; then  # SM clocks per stage, busy samples
    cp "$UP/clocks.csv" "$OUT/upstream_clocks.csv"; cp "$UP/stage_marks.txt" "$OUT/upstream_stage_marks.txt"
    python3 "$R/tools/gpu_clocks.py" "$UP/clocks.csv" --phases "$UP/stage_marks.txt"
  fi
  local logf
  logf=$(ls -t "$UP"/logs/*.txt 2>/dev/null | head -1)
  [ -n "$logf" ] || { log "no upstream log yet"; tail -20 "$UP/stdout.txt" 2>/dev/null; return; }
  cp "$logf" "$OUT/upstream_log.txt"
  python3 "$R/tools/upstream_step_times.py" "$OUT/upstream_log.txt" --config "$UP/bench_config.json" \
    --json "$OUT/upstream_steps.json"
}

if [ -e "$UP/started" ]; then
  log "a run was started earlier in $UP: waiting for it"
else
  rm -rf "$UP"
  start_run "$@" || { log "could not start"; exit 1; }
fi
t0=$SECONDS
while [ ! -e "$UP/rc" ] && [ $((SECONDS - t0)) -lt "$WAIT_S" ]; do
  sleep 5
  [ $(((SECONDS - t0) % 60)) -lt 5 ] && log "$(tail -1 "$UP/stdout.txt" 2>/dev/null | cut -c1-150)"
done
tail -8 "$UP/stdout.txt" 2>/dev/null
collect
if [ -e "$UP/rc" ]; then
  log "upstream finished, exit status $(cat "$UP/rc")"
  if [ -n "${UP_CACHE_OUT:-}" ] && [ "$(cat "$UP/rc")" = 0 ] && [ ! -e "$UP/cache_saved" ]; then
    python3 "$R/tools/compile_cache.py" save "$CACHE_DIR" "$UP_CACHE_OUT/$CACHE_FILE" | tee -a "$UP/compile_cache.txt"
    touch "$UP/cache_saved"; cp "$UP/compile_cache.txt" "$OUT/upstream_compile_cache.txt"
  fi
  if [ "$(cat "$UP/rc")" != 0 ]; then  # the exception itself, which torchrun's summary above leaves out
    grep -E "^(\[rank[0-9]+\]: )?[A-Za-z_.]*(Error|Exception)[:(]" "$UP/stdout.txt" 2>/dev/null | head -3 | cut -c1-300
    grep -F "File \"$UP/" "$UP/stdout.txt" 2>/dev/null | tail -2 | cut -c1-300  # where in upstream's code
  fi
else
  log "upstream still running after ${WAIT_S}s: run the same command again to wait for it"
fi
