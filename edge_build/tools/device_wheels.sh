#!/usr/bin/env bash
# Fetches the wheels of edge_build/tools/device_wheels.txt for a GPU machine without
# network (CPython 3.12, x86_64): all into .whl/ except onnxruntime-gpu, which
# is unpacked, packed again as an xz tarball and split into 52 MB parts
# under .device/ort/ (a device call carries 64 MiB),
# and pycuda's sdist goes to .device/pycuda/ (it is built there).
# Run here, in the repository root; .whl/ and .device/ are git-ignored.
# Usage: edge_build/tools/device_wheels.sh [PYTHON]
set -euo pipefail
py=${1:-python3}
list=$(dirname "$0")/device_wheels.txt
mkdir -p .whl .device/ort .device/pycuda /tmp/cosyedge-wheels
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
      --platform manylinux_2_27_x86_64 --platform manylinux1_x86_64)
grep -v -e '^#' -e '^$' "$list" | while read -r pin; do
  case "$pin" in
    antlr4-python3-runtime==*) "$py" -m pip wheel -q --no-deps -w .whl "$pin" ;;
    pycuda==*) "$py" -m pip download -q --no-deps --no-binary=pycuda -d .device/pycuda "$pin" ;;
    onnxruntime-gpu==*) "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp "${plat[@]}" -d /tmp/cosyedge-wheels "$pin" ;;
    *) "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${plat[@]}" -d .whl "$pin" ;;
  esac
done
# the wheel's files as an xz tarball (203 MB against the wheel's 256: four parts, not five)
rm -rf .device/ort/part-* /tmp/cosyedge-wheels/ort && mkdir -p /tmp/cosyedge-wheels/ort
( cd /tmp/cosyedge-wheels/ort && unzip -q ../onnxruntime_gpu-*.whl && tar cf - . | xz -T0 -9e ) \
  | split -b 52000000 -d - .device/ort/part-
ls -l .whl .device/ort
