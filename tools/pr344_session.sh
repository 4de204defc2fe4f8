#!/usr/bin/env bash
# Upstream PR #344's own code beside our candidate (and record) on one GPU, in three device calls
# on one warm machine (issue a call within 30 s of the last one's end: the machine goes back then).
#
#   a  start #344's short run in its own session (tools/upstream_pr344.sh, ~8 minutes of compile),
#      GPU tests beside its compile (small shapes only: they must not share the GPU with its timed
#      steps; TESTS_PATHS and TESTS_K choose them, by default the whole-compile training test, the
#      one `test_train_gpu.py` case no call has finished), then wait for it
#   b  record and candidate interleaved at stages 1 and 2 (if #344 is still running, the call only
#      waits for it and says to run part b again)
#   c  stage 3, one arm per process (two stage-3 graph arms do not fit an 80 GB card)
#
# On the GPU machine, repo root as cwd, `.carry` and `.whl` carried (see tools/device_run.sh and
# tools/upstream_pr344.sh for what they hold):   bash tools/pr344_session.sh a|b|c
# Everything a part writes goes to /tmp/pr344_session/<part>/ and is packed into
# $OUT/pr344_<part>.tgz after every step, so a call cut by its time limit still brings back what
# finished.  Here, after part c: `speedrun bench project` of the three stages' JSONs with
# `--upstream pr344=<b>/upstream_steps.json:candidate` (the folder's README names the files).
#
# The bench budgets below leave room for each arm's warmup, captures and self-checks besides its
# timed steps (docs/status.md, "Time a bench needs").
set -u
part=${1:-}
case $part in a|b|c) ;; *) echo "usage: $0 a|b|c" >&2; exit 2 ;; esac
R=$(pwd)
W=/tmp/pr344_session/$part
O=${OUT:-$R/bench_out}
mkdir -p "$W" "$O"
pack() { tar czf "$O/pr344_$part.tgz" -C "$W" .; }
git log --oneline -1 > "$W/commit.txt" 2>/dev/null
UPA="--scheduled 45 --extension 2 --val-tokens 2097152"
V=model.attention_backend=varlen
pr344() {  # wait (up to $1 s) for the run part a started, collecting its outputs into $W/pr344
  OUT=$W/pr344 WAIT_S=$1 DATA_DIR=/tmp/webmix_up bash "$R/tools/upstream_pr344.sh" $UPA 2>&1 | tail -15
}
export UP_DIR=/tmp/up344 UP_NAME=pr344 UP_PRESET=candidate CHAIN=3 HOST_STEPS=3 SYNC_SCAN=0
case $part in
  a)
    pr344 1; pack
    OUT=$W/tests BUDGET_S=${TESTS_BUDGET_S:-300} TESTS_S=${TESTS_BUDGET_S:-300} TESTS_ARGS="--timeout=200" \
      TESTS_PATHS="${TESTS_PATHS:-tests/gpu/test_train_gpu.py}" TESTS_K="${TESTS_K-compiles_whole}" \
      bash "$R/tools/device_run.sh" tests; pack
    pr344 "${WAIT_S:-220}"; pack ;;
  b)
    if [ ! -e /tmp/up344/rc ]; then  # still running: this call only waits (the benches need a call of their own)
      pr344 "${WAIT_S:-500}"; pack
      [ -e /tmp/up344/rc ] && echo "PR #344's run finished: run part b again for the benches" >&2
      exit 1
    fi
    OUT=$W BUDGET_S=${BUDGET_S:-560} STAGES="0 1" BENCH_ARMS="recg=record:$V candg=candidate:$V" \
      bash "$R/tools/device_run.sh" record; pack ;;
  c)
    OUT=$W/cand BUDGET_S=270 STAGES=2 BENCH_ARMS="candg=candidate:$V" bash "$R/tools/device_run.sh" record; pack
    OUT=$W/rec BUDGET_S=270 STAGES=2 BENCH_ARMS="recg=record:$V" bash "$R/tools/device_run.sh" record; pack ;;
esac
date -u
