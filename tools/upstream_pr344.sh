#!/usr/bin/env bash
# Run upstream modded-nanogpt PR #344 (commit c4c209d, patched by upstream_pr344.py) on one GPU for a
# short schedule, exactly as upstream_f411b3d.sh runs f411b3d (same waiting, same outputs in $OUT).
#
# On the GPU machine, repo root as cwd, `.carry` carried:
#   bash tools/upstream_pr344.sh --scheduled 45 --extension 2 --val-tokens 2097152
#   .carry/pr344/{train_gpt,triton_kernels,dc_triton_kernels}.py   (git show c4c209d:<file>)
#   .carry/upstream/tiktoken_cache/ and .carry/webmix_{train,val}_000000.bin.xz, as for f411b3d
# Its own working folder (/tmp/up344) lets it run after or beside an f411b3d run of the same machine.
R=$(pwd)
export PATCHER="$R/tools/upstream_pr344.py"
export UP_SRC=${UP_SRC:-$R/.carry/pr344}
export UP_DIR=${UP_DIR:-/tmp/up344}
exec bash "$R/tools/upstream_f411b3d.sh" "$@"
