#!/usr/bin/env bash
# Fill the git-ignored folders that device calls carry, in a fresh checkout (repo root as cwd):
#   .carry/webmix_{train,val}_000000.bin.xz     the webmix shards, from $SHARED/data
#   .carry/gpt2/, .carry/upstream/tiktoken_cache/   the GPT-2 tokenizer files, from $SHARED/tokenizer
#   .carry/upstream/, .carry/pr344/             upstream f411b3d's and PR #344's (c4c209d)
#                                               train_gpt.py, triton_kernels.py, dc_triton_kernels.py
#   .whl/                                       nvidia-cudnn-frontend for the GPU machine's Python 3.12
#
# Usage:  bash tools/carry_prepare.sh MODDED_NANOGPT_GIT_DIR
#   MODDED_NANOGPT_GIT_DIR: a clone (or bare mirror) of KellerJordan/modded-nanogpt holding both
#   commits.  SHARED (default ../shared); WHEELS=0 skips the wheel download (it needs the package
#   registry); UPSTREAM_COMMIT / PR344_COMMIT (default f411b3d / c4c209d) name the two commits.
# Nothing here is committed: .carry/ and .whl/ are in .gitignore.
set -eu
git_dir=${1:-}
SHARED=${SHARED:-../shared}
UPSTREAM_COMMIT=${UPSTREAM_COMMIT:-f411b3d}
PR344_COMMIT=${PR344_COMMIT:-c4c209d}
CUDNN_FRONTEND=${CUDNN_FRONTEND:-nvidia-cudnn-frontend==1.18.0}
die() { echo "carry_prepare: $*" >&2; exit 2; }
[ -n "$git_dir" ] || die "usage: bash tools/carry_prepare.sh MODDED_NANOGPT_GIT_DIR"
git --git-dir="$git_dir" rev-parse --git-dir > /dev/null 2>&1 || git -C "$git_dir" rev-parse --git-dir > /dev/null 2>&1 \
  || die "$git_dir is not a git repository (a clone of KellerJordan/modded-nanogpt)"
[ -d "$git_dir/.git" ] && git_dir=$git_dir/.git
for c in "$UPSTREAM_COMMIT" "$PR344_COMMIT"; do
  git --git-dir="$git_dir" cat-file -e "$c^{commit}" 2> /dev/null || die "$git_dir has no commit $c (fetch it first)"
done
ls "$SHARED"/data/webmix_*.bin.xz > /dev/null 2>&1 || die "no $SHARED/data/webmix_*.bin.xz (set SHARED)"
[ -d "$SHARED/tokenizer/gpt2" ] && [ -d "$SHARED/tokenizer/tiktoken_cache" ] || die "no $SHARED/tokenizer/{gpt2,tiktoken_cache}"

mkdir -p .carry/upstream .carry/pr344
cp "$SHARED"/data/webmix_*.bin.xz .carry/
rm -rf .carry/gpt2 .carry/upstream/tiktoken_cache
cp -r "$SHARED/tokenizer/gpt2" .carry/gpt2
cp -r "$SHARED/tokenizer/tiktoken_cache" .carry/upstream/tiktoken_cache
chmod -R u+w .carry  # the shared copies are read-only; the next prepare overwrites them
for f in train_gpt.py triton_kernels.py dc_triton_kernels.py; do
  git --git-dir="$git_dir" show "$UPSTREAM_COMMIT:$f" > ".carry/upstream/$f"
  git --git-dir="$git_dir" show "$PR344_COMMIT:$f" > ".carry/pr344/$f"
done
if [ "${WHEELS:-1}" != 0 ]; then
  mkdir -p .whl
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "$CUDNN_FRONTEND"
fi
du -sh .carry
[ -d .whl ] && du -sh .whl
exit 0
