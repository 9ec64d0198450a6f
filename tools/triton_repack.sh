#!/bin/bash
# A Triton wheel cut down to what runs NVIDIA Hopper kernels, as one .tar.xz that a device call
# can carry (64 MiB with the tree): the cp312 wheel of Triton 3.9.0 is 285.7 MB; without the AMD
# backend, the profiler (proton, CUPTI), the legacy ptxas (sm < 90), cuobjdump and nvdisasm, and
# with libtriton.so stripped, it is about 56 MB.
#
#   tools/triton_repack.sh 3.9.0 build/triton39      # -> build/triton39/triton.tar.xz
#
# On the device: tar xJf build/triton39/triton.tar.xz -C /tmp/t39, then PYTHONPATH=/tmp/t39
# (ahead of the machine's Triton 3.6, which torch 2.11 pins) and TRITON_BACKENDS_IN_TREE=1.
set -euo pipefail
version=${1:?usage: tools/triton_repack.sh VERSION OUTDIR}
out=${2:?usage: tools/triton_repack.sh VERSION OUTDIR}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  -d "$work" "triton==$version"
(cd "$work" && unzip -q triton-*.whl 'triton/*')
t=$work/triton
# sm_90 and newer compile with ptxas-blackwell (the backend's get_ptxas); "ptxas" serves sm < 90
rm -rf "$t/backends/amd" "$t/backends/nvidia/lib/cupti" "$t/backends/nvidia/lib/cupti-blackwell" \
       "$t/backends/nvidia/bin/ptxas" "$t/backends/nvidia/bin/cuobjdump" "$t/backends/nvidia/bin/nvdisasm" \
       "$t/_C/libproton.so" "$t/profiler"
strip --strip-unneeded "$t/_C/libtriton.so"
mkdir -p "$out"
tar cf - -C "$work" triton | xz -T0 -9e > "$out/triton.tar.xz"
ls -l "$out/triton.tar.xz"
