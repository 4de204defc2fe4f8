#!/usr/bin/env bash
# The `fa4` attention backend's packages (flash-attn-4 and NVIDIA's CuTe DSL with its CUDA 13
# libraries) onto a GPU machine that has no network, in two device calls on one warm machine:
# the CUDA 13 library wheel alone is ~92 MB and a call carries at most 64 MiB.
#
#   prepare  here (needs the package index): downloads the wheels into .fa4/ and splits them into
#            .fa4a/ (most of the CUDA 13 libraries, xz-compressed) and .fa4b/ (the rest of them and
#            every other wheel); prints each folder's size.  All three folders are git-ignored.
#   stage    device call 1, `.fa4a` carried: keeps its part in /tmp/fa4parts for the next call
#            (a warm machine keeps /tmp between calls; the next call must come within its idle time).
#   install  device call 2, `.fa4b` carried: joins the parts, installs the wheels into $FA4_SITE
#            (pip --target, no index) with the CUDA 13 libraries beside them, and checks that
#            `speedrun.attention` finds the fa4 backend usable.  A process finds them through
#            PYTHONPATH (`fa4_pythonpath` below; tools/device_run.sh adds it when $FA4_SITE exists):
#            the site folder and the CuTe DSL's own package folder, which its .pth file would add
#            in a site-packages folder but which a PYTHONPATH folder's .pth files do not.
#
# Usage: bash tools/fa4_carry.sh prepare|stage|install
set -euo pipefail
FA4_VERSION=4.0.0b36
CUTLASS_VERSION=4.8.1
# MiB of the compressed libraries in .fa4a: call 1 carries it beside the tracked tree (~6 MB);
# call 2 then carries the rest (.fa4b, ~14 MB) with .carry (~42 MB) and .whl: both under 64 MiB.
PART_A_MB=${PART_A_MB:-57}
PARTS=${FA4_PARTS:-/tmp/fa4parts}  # where call 1 leaves its part for call 2
FA4_SITE=${FA4_SITE:-/tmp/fa4site}
fa4_pythonpath() { echo "$FA4_SITE:$FA4_SITE/nvidia_cutlass_dsl/dsl_packages"; }
what=${1:-}
case $what in
  prepare)
    rm -rf .fa4 .fa4a .fa4b && mkdir -p .fa4/wheels .fa4/cu13 .fa4a .fa4b
    py=(--python-version 3.12 --only-binary=:all: --platform manylinux_2_28_x86_64 --no-deps -d .fa4/wheels)
    python3 -m pip download -q "${py[@]}" "flash-attn-4==$FA4_VERSION" "nvidia-cutlass-dsl==$CUTLASS_VERSION" \
      "nvidia-cutlass-dsl-libs-base==$CUTLASS_VERSION" "nvidia-cutlass-dsl-libs-core==$CUTLASS_VERSION" \
      "nvidia-cutlass-dsl-libs-cu13==$CUTLASS_VERSION" "apache-tvm-ffi>=0.1.11,<0.2" torch-c-dlpack-ext \
      "quack-kernels>=0.5.3"
    big=$(ls .fa4/wheels/nvidia_cutlass_dsl_libs_cu13-*.whl)
    (cd .fa4/cu13 && python3 -m zipfile -e "$OLDPWD/$big" .)
    tar cf - -C .fa4/cu13 . | xz -T0 -9e > .fa4/cu13.tar.xz
    split -b "${PART_A_MB}M" -d .fa4/cu13.tar.xz .fa4/cu13.tar.xz.part
    mv .fa4/cu13.tar.xz.part00 .fa4a/
    mv .fa4/cu13.tar.xz.part* .fa4b/
    for w in .fa4/wheels/*.whl; do [ "$w" = "$big" ] || cp "$w" .fa4b/; done
    (cd .fa4 && sha256sum cu13.tar.xz) > .fa4b/cu13.tar.xz.sha256
    du -sh .fa4a .fa4b ;;
  stage)
    [ -e .fa4a/cu13.tar.xz.part00 ] || { echo "no .fa4a/cu13.tar.xz.part00: run prepare here and carry .fa4a" >&2; exit 2; }
    mkdir -p "$PARTS" && cp .fa4a/cu13.tar.xz.part* "$PARTS"/
    ls -la "$PARTS" ;;
  install)
    [ -e "$PARTS/cu13.tar.xz.part00" ] || {
      echo "no $PARTS/cu13.tar.xz.part00: run 'stage' with .fa4a carried in the call before, on this machine" >&2; exit 2; }
    cat "$PARTS"/cu13.tar.xz.part* .fa4b/cu13.tar.xz.part* > "$PARTS/cu13.tar.xz"
    (cd "$PARTS" && sha256sum -c --quiet "$OLDPWD/.fa4b/cu13.tar.xz.sha256") || {
      echo "the joined CUDA 13 libraries differ from what prepare split: carry .fa4a and .fa4b of one prepare" >&2; exit 3; }
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$FA4_SITE" \
      .fa4b/*.whl
    xz -dc "$PARTS/cu13.tar.xz" | tar xf - -C "$FA4_SITE"
    PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$(fa4_pythonpath) python3 -c '
import torch
from speedrun.attention import backend_problem
problem = backend_problem("fa4", torch.device("cuda")) if torch.cuda.is_available() else "no GPU here"
print("fa4 backend:", "usable" if problem is None else problem)'
    echo "export PYTHONPATH=\$PYTHONPATH:$(fa4_pythonpath)" ;;
  *) echo "usage: $0 prepare|stage|install" >&2; exit 2 ;;
esac
