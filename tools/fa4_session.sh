#!/usr/bin/env bash
# The fa4 attention backend on a GPU, in four device calls on one warm machine (issue each within
# 30 s of the last one's end: the machine goes back then, and with it what call 1 staged).
#
#   1  carry `.fa4a` only: stage its part of FA4's packages (tools/fa4_carry.sh stage), then GPU
#      tests that need no carried data (TESTS_PATHS, TESTS_K, TESTS_ARGS; by default the compiled
#      graph-vs-eager tests)
#   2  carry `.fa4b`, `.carry` and `.whl`: install FA4 (tools/fa4_carry.sh install), the fused
#      backends' GPU tests for fa4 and cudnn, then every attention backend timed at stage-3 shapes
#      (benchmarks/bench_attention.py: fa4, cudnn, varlen, flex interleaved)
#   3  carry `.carry` and `.whl`: the candidate's stage-3 step on fa4 and on cudnn (BACKENDS="fa4
#      varlen" names others), one arm per process (two stage-3 graph arms do not fit an 80 GB
#      card), back to back
#   4  the same for the record
#
# Before call 1, here: `bash tools/fa4_carry.sh prepare` (downloads; makes .fa4a and .fa4b).
# On the GPU machine, repo root as cwd:   bash tools/fa4_session.sh 1|2|3|4
# Everything a part writes goes to /tmp/fa4_session/<part>/ and is packed into $OUT/fa4_<part>.tgz
# after every step, so a call cut by its time limit still brings back what finished.
set -u
part=${1:-}
case $part in 1|2|3|4) ;; *) echo "usage: $0 1|2|3|4" >&2; exit 2 ;; esac
R=$(pwd)
W=/tmp/fa4_session/$part
O=${OUT:-$R/bench_out}
mkdir -p "$W" "$O"
pack() { tar czf "$O/fa4_$part.tgz" -C "$W" .; }
git log --oneline -1 > "$W/commit.txt" 2>/dev/null
export CHAIN=3 HOST_STEPS=1 SYNC_SCAN=0
case $part in
  1)
    bash "$R/tools/fa4_carry.sh" stage > "$W/stage.txt" 2>&1 || { cat "$W/stage.txt"; pack; exit 1; }
    pack
    OUT=$W/tests BUDGET_S=${TESTS_BUDGET_S:-540} TESTS_S=${TESTS_BUDGET_S:-540} TESTS_ARGS="${TESTS_ARGS:---timeout=400}" \
      TESTS_PATHS="${TESTS_PATHS:-tests/gpu/test_graphs_gpu.py}" TESTS_K="${TESTS_K-compiled}" \
      bash "$R/tools/device_run.sh" tests; pack ;;
  2)
    bash "$R/tools/fa4_carry.sh" install > "$W/install.txt" 2>&1; rc=$?
    cat "$W/install.txt"; pack
    [ $rc = 0 ] || exit 1
    OUT=$W/tests BUDGET_S=300 TESTS_S=300 TESTS_ARGS="--timeout=200" \
      TESTS_PATHS=tests/gpu/test_attention_fused_gpu.py \
      bash "$R/tools/device_run.sh" tests; pack
    OUT=$W/attention BUDGET_S=240 bash "$R/tools/device_run.sh" attention > "$W/attention.txt" 2>&1
    tail -40 "$W/attention.txt"; pack ;;
  3|4)
    preset=$([ "$part" = 3 ] && echo candidate || echo record)
    for backend in ${BACKENDS:-fa4 cudnn}; do  # BACKENDS: which, in order; the bench budgets: docs/status.md, "Time a bench needs"
      arm=${preset:0:4}_$backend=$preset:model.attention_backend=$backend
      OUT=$W/$backend BUDGET_S=270 STAGES=2 BENCH_ARMS="$arm" bash "$R/tools/device_run.sh" record 2>&1 | tail -12
      pack
    done ;;
esac
date -u
