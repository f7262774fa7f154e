#!/usr/bin/env bash
# Fetches the wheels of edge_build/tools/device_wheels.txt for a GPU machine without
# network (CPython 3.12, x86_64): all into .whl/ except onnxruntime-gpu, which
# is unpacked, packed again as an xz tarball and split into 52 MB parts
# under .device/ort/ (a device call carries 64 MiB),
# and pycuda's sdist goes to .device/pycuda/ (it is built there).
# The `cloud:` pins and this machine's mosquitto go to .device/cloud/ (device_run.sh's cloud step):
# nvidia-pytriton's server with its Python 3.12 stub only (triton.tar.xz), the stub's numpy 1.26 and
# tritonclient's wheels (wheels/), mosquitto with the libraries it links beyond glibc (mosquitto.tar.xz).
# Run here, in the repository root; .whl/ and .device/ are git-ignored.
# Usage: edge_build/tools/device_wheels.sh [PYTHON] [cloud]   (cloud: .device/cloud/ alone)
set -euo pipefail
py=${1:-python3}
list=$(dirname "$0")/device_wheels.txt
mkdir -p .whl .device/ort .device/pycuda .device/cloud/wheels /tmp/cosyedge-wheels
only=${2:-}
plat=(--platform manylinux_2_35_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
      --platform manylinux_2_27_x86_64 --platform manylinux1_x86_64)
grep -v -e '^#' -e '^$' "$list" | while read -r pin; do
  case "$only:$pin" in cloud:cloud:*) ;; cloud:*) continue ;; esac
  case "$pin" in
    cloud:nvidia-pytriton==*) "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp "${plat[@]}" -d /tmp/cosyedge-wheels "${pin#cloud:}" ;;
    cloud:*) "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${plat[@]}" -d .device/cloud/wheels "${pin#cloud:}" ;;
    antlr4-python3-runtime==*) "$py" -m pip wheel -q --no-deps -w .whl "$pin" ;;
    pycuda==*) "$py" -m pip download -q --no-deps --no-binary=pycuda -d .device/pycuda "$pin" ;;
    onnxruntime-gpu==*) "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp "${plat[@]}" -d /tmp/cosyedge-wheels "$pin" ;;
    *) "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${plat[@]}" -d .whl "$pin" ;;
  esac
done
# the cloud step's server: the wheel's files less the other Pythons' stubs and libpython 3.13 (24 MB)
t=/tmp/cosyedge-wheels/pytriton && rm -rf "$t" && mkdir -p "$t"
( cd "$t" && unzip -q ../nvidia_pytriton-*.whl && rm -rf nvidia_pytriton-*.dist-info nvidia_pytriton.libs/libpython3-* \
  && find pytriton/tritonserver/python_backend_stubs -mindepth 1 -maxdepth 1 ! -name 3.12 -exec rm -rf {} + \
  && tar cf - . | xz -T0 -9 ) >.device/cloud/triton.tar.xz
mosq=$(command -v mosquitto || echo /usr/sbin/mosquitto)
m=/tmp/cosyedge-wheels/mosquitto && rm -rf "$m" && mkdir -p "$m/lib" && cp "$mosq" "$m/"
ldd "$mosq" | awk '/=>/ {print $3}' | grep -v -E '/lib(c|m|resolv)\.so|ld-linux' | xargs -r cp -L -t "$m/lib"
tar cf - -C /tmp/cosyedge-wheels mosquitto | xz -T0 -9 >.device/cloud/mosquitto.tar.xz
if [ "$only" = cloud ]; then ls -l .device/cloud .device/cloud/wheels; exit 0; fi
# the wheel's files as an xz tarball (203 MB against the wheel's 256: four parts, not five)
rm -rf .device/ort/part-* /tmp/cosyedge-wheels/ort && mkdir -p /tmp/cosyedge-wheels/ort
( cd /tmp/cosyedge-wheels/ort && unzip -q ../onnxruntime_gpu-*.whl && tar cf - . | xz -T0 -9e ) \
  | split -b 52000000 -d - .device/ort/part-
ls -l .whl .device/ort
