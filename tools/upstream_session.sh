#!/usr/bin/env bash
# An upstream code's short run beside our record and candidate on one GPU, on one attention
# backend, in three device calls on one warm machine (issue a call within 30 s of the last one's
# end: the machine goes back then).
#
#   UPSTREAM  pr344 (default: modded-nanogpt PR #344, tools/upstream_pr344.sh, compared with our
#             candidate) or f411b3d (tools/upstream_f411b3d.sh, compared with our record)
#   BACKEND   varlen (default), cudnn or fa4: upstream's attention shim and every arm of ours use it
#             (fa4: run `tools/fa4_session.sh 1` in the call before part a, carrying `.fa4a`, and
#             carry `.fa4b` beside `.carry` and `.whl` in part a, which then installs FA4)
#
#   a  start the upstream run in its own session (~8 minutes of compile), GPU tests beside its
#      compile (small shapes only: they must not share the GPU with its timed steps; TESTS_PATHS
#      and TESTS_K choose them, by default the whole-compile training test), then wait for it;
#      with A_WARM_PRESETS (e.g. "candidate") part a compiles those arms instead of testing, at
#      A_WARM_STAGES (default "0 1": a stage-3 arm may not fit beside upstream's run in 80 GB)
#      within A_WARM_S (default 330 s), so that part b's warmups load from the inductor cache
#   b  record and candidate interleaved at stages 1 and 2; if upstream is still running the call
#      first waits for it (up to WAIT_S, default 300 s) and benches only if at least B_MIN_S (default
#      240 s) of BUDGET_S (default 560 s) is left, else says to run part b again; B_PRESETS (default
#      "record candidate") chooses the arms and B_STAGES (default "0 1") the stages (one arm fits
#      an 80 GB card at stage 3 too: B_PRESETS=candidate B_STAGES="0 1 2" is the shortest session)
#   c  stage 3, one arm per process (two stage-3 graph arms do not fit an 80 GB card); C_PRESETS
#      (default "candidate record") chooses the arms, C_BUDGET_S (default 270) caps each
#
# UP_SESSION_UP_DIR (default /tmp/up_<upstream>-<backend>) is where the upstream run lives.
# On the GPU machine, repo root as cwd, `.carry` and `.whl` carried (see tools/device_run.sh and
# tools/upstream_f411b3d.sh for what they hold):   [UPSTREAM=..] [BACKEND=..] bash tools/upstream_session.sh a|b|c
# Everything a part writes goes to /tmp/upstream_session/<upstream>-<backend>/<part>/ and is
# packed into $OUT/<upstream>-<backend>_<part>.tgz after every step, so a call cut by its time
# limit still brings back what finished.  Here, after part c: `speedrun bench project` of the
# three stages' JSONs with `--upstream <upstream>=<b>/upstream_steps.json:<preset>` (the
# folder's README names the files).
#
# Part a's upstream run also saves its torch.compile cache as $OUT/up_<name>.compile_cache.tar.gz
# when it packs into 15 MiB (tools/compile_cache.py prints the size either way): keep it here as
# .carry/compile_cache/up_<name>.compile_cache.tar.gz and the next session's run of the same
# upstream and backend loads its kernels instead of compiling them.
#
# The bench budgets below leave room for each arm's warmup, captures and self-checks besides its
# timed steps (docs/status.md, "Time a bench needs").
set -u
part=${1:-}
case $part in a|b|c) ;; *) echo "usage: [UPSTREAM=pr344|f411b3d] [BACKEND=varlen|cudnn|fa4] $0 a|b|c" >&2; exit 2 ;; esac
UPSTREAM=${UPSTREAM:-pr344}
BACKEND=${BACKEND:-varlen}
case $UPSTREAM in
  pr344) up_script=upstream_pr344.sh; up_preset=candidate ;;
  f411b3d) up_script=upstream_f411b3d.sh; up_preset=record ;;
  *) echo "UPSTREAM must be pr344 or f411b3d, not $UPSTREAM" >&2; exit 2 ;;
esac
case $BACKEND in varlen|cudnn|fa4) ;; *) echo "BACKEND must be varlen, cudnn or fa4, not $BACKEND" >&2; exit 2 ;; esac
for preset in ${A_WARM_PRESETS:-} ${B_PRESETS:-} ${C_PRESETS:-}; do
  case $preset in candidate|record) ;; *) echo "A_WARM_PRESETS, B_PRESETS and C_PRESETS hold candidate and/or record, not $preset" >&2; exit 2 ;; esac
done
arm_of() { case $1 in candidate) echo "candg=candidate:$V" ;; record) echo "recg=record:$V" ;; esac; }
arms_of() { local p a=""; for p in "$@"; do a="$a $(arm_of "$p")"; done; echo "${a# }"; }  # BENCH_ARMS of presets
R=$(pwd)
name=$UPSTREAM-$BACKEND
W=/tmp/upstream_session/$name/$part
O=${OUT:-$R/bench_out}
mkdir -p "$W" "$O"
pack() { tar czf "$O/${name}_$part.tgz" -C "$W" .; }
git log --oneline -1 > "$W/commit.txt" 2>/dev/null
UPA="--scheduled 45 --extension 2 --val-tokens 2097152"
V=model.attention_backend=$BACKEND
upstream() {  # wait (up to $1 s) for the run part a started, collecting its outputs into $W/upstream
  # (its compile cache, when it packs small enough, beside the part's archive: see upstream_f411b3d.sh)
  OUT=$W/upstream WAIT_S=$1 DATA_DIR=/tmp/webmix_up SPEEDRUN_SHIM_BACKEND=$BACKEND UP_CACHE_OUT=$O \
    bash "$R/tools/$up_script" $UPA 2>&1 | tail -15
}
export UP_DIR=${UP_SESSION_UP_DIR:-/tmp/up_$name} UP_NAME=$UPSTREAM UP_PRESET=$up_preset CHAIN=3 HOST_STEPS=3 SYNC_SCAN=0
case $part in
  a)
    if [ "$BACKEND" = fa4 ] && [ ! -d "${FA4_SITE:-/tmp/fa4site}" ]; then
      bash "$R/tools/fa4_carry.sh" install > "$W/fa4_install.txt" 2>&1 || { cat "$W/fa4_install.txt"; pack; exit 1; }
    fi
    upstream 1; pack
    if [ -n "${A_WARM_PRESETS:-}" ]; then
      # Instead of tests: compile our arms beside upstream's compile (the fewest timed steps a bench
      # takes; its timings mean nothing), so part b's warmups load their kernels from the inductor cache.
      OUT=$W/warm BUDGET_S=${A_WARM_S:-330} STAGES="${A_WARM_STAGES:-0 1}" BENCH_ARMS="$(arms_of $A_WARM_PRESETS)" \
        BENCH_STEPS=20 HOST_STEPS=0 CHAIN=1 bash "$R/tools/device_run.sh" record > "$W/warm_log.txt" 2>&1
      tail -5 "$W/warm_log.txt"
    else
      OUT=$W/tests BUDGET_S=${TESTS_BUDGET_S:-300} TESTS_S=${TESTS_BUDGET_S:-300} TESTS_ARGS="--timeout=200" \
        TESTS_PATHS="${TESTS_PATHS:-tests/gpu/test_train_gpu.py}" TESTS_K="${TESTS_K-compiles_whole}" \
        bash "$R/tools/device_run.sh" tests
    fi
    pack
    upstream "${WAIT_S:-220}"; pack ;;
  b)
    b_start=$(date +%s)
    if [ ! -e "$UP_DIR/rc" ]; then  # still running: wait for it, then bench with what is left of the call
      upstream "${WAIT_S:-300}"; pack
      if [ ! -e "$UP_DIR/rc" ]; then echo "$UPSTREAM's run is still going: run part b again" >&2; exit 1; fi
    fi
    budget=$(( ${BUDGET_S:-560} - ($(date +%s) - b_start) ))
    if [ "$budget" -lt "${B_MIN_S:-240}" ]; then  # the benches would be cut: they need a call of their own
      echo "$UPSTREAM's run finished, ${budget} s left of the call: run part b again for the benches" >&2; exit 1
    fi
    OUT=$W BUDGET_S=$budget STAGES="${B_STAGES:-0 1}" BENCH_ARMS="$(arms_of ${B_PRESETS:-record candidate})" \
      bash "$R/tools/device_run.sh" record; pack ;;
  c)
    for preset in ${C_PRESETS:-candidate record}; do
      case $preset in candidate) dir=cand ;; record) dir=rec ;; esac
      OUT=$W/$dir BUDGET_S=${C_BUDGET_S:-270} STAGES=2 BENCH_ARMS="$(arm_of "$preset")" bash "$R/tools/device_run.sh" record; pack
    done ;;
esac
date -u
