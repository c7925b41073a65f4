#!/usr/bin/env bash
# Prepares, on the dev machine, the Mooncake CUDA transfer engine that
# benchmarks/gpu_pd_run.sh carries to the GPU machine, as .whl/mooncake-cuda.tar.xz
# (gitignored; .whl/grammar and .whl/http come from benchmarks/gpu_http_prep.sh).
#
# The PyPI wheel mooncake-transfer-engine 0.3.13.post1 (cp312, CUDA 12 build) is 98 MB, over
# the device tool's 64 MiB carry limit (279 MB unpacked: the store, EP and PG extensions,
# mooncake_master, transfer_engine_bench...). `from mooncake.engine import TransferEngine`
# needs only, under site/:
#   mooncake/__init__.py, buffer_pool.py  (the package import; buffer_pool tolerates a
#                                          missing mooncake.store)
#   mooncake/engine.so, libasio.so, libetcd_wrapper.so   (engine.so's RPATH is $ORIGIN and
#   mooncake_transfer_engine.libs/ libgflags, libglog, libjsoncpp, libyaml-cpp   ../*.libs)
# plus what engine.so links from the system (readelf -d: NEEDED):
#   lib/libcudart.so.12    from nvidia-cuda-runtime-cu12 (the GPU image has CUDA 13 only;
#                          libcuda.so.1 is the machine's driver)
#   syslibs/               Debian 12's libibverbs, libmlx5, libnuma and libcurl with every
#                          library they link (ldd), copied from this machine; the run links
#                          on its library path only those the GPU machine lacks
# All shared libraries stripped (--strip-unneeded); xz: 49 MB -> 11.5 MB.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEEL_DIR=${MOONCAKE_WHEEL_DIR:-/tmp/mcw}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
DL=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64)
ls "$WHEEL_DIR"/mooncake_transfer_engine-0.3.13.post1-*.whl > /dev/null 2>&1 \
  || .venv/bin/pip download -q "${DL[@]}" -d "$WHEEL_DIR" mooncake-transfer-engine==0.3.13.post1
.venv/bin/pip download -q "${DL[@]}" -d "$WORK/cu12" nvidia-cuda-runtime-cu12==12.8.90
unzip -q "$WHEEL_DIR"/mooncake_transfer_engine-0.3.13.post1-*.whl -d "$WORK/wheel"
unzip -q "$WORK"/cu12/*.whl -d "$WORK/cu12"
T=$WORK/tree
mkdir -p "$T/site/mooncake" "$T/site/mooncake_transfer_engine.libs" "$T/lib" "$T/syslibs"
for f in __init__.py buffer_pool.py engine.so libasio.so libetcd_wrapper.so; do
  cp "$WORK/wheel/mooncake/$f" "$T/site/mooncake/"
done
for f in libgflags-8aee0f6c.so.2.1.2 libglog-6ed04f2c.so.0.0.0 libjsoncpp-4b349785.so.1.8.4 \
  libyaml-cpp-2ec4b324.so.0.7.0; do
  cp "$WORK/wheel/mooncake_transfer_engine.libs/$f" "$T/site/mooncake_transfer_engine.libs/"
done
cp "$WORK/cu12/nvidia/cuda_runtime/lib/libcudart.so.12" "$T/lib/"
SYS=/lib/x86_64-linux-gnu
for l in libibverbs.so.1 libmlx5.so.1 libnuma.so.1 libcurl.so.4; do
  echo "$SYS/$l"
  ldd "$SYS/$l" | awk '/=>/ {print $3}'
done | sort -u | grep -vE '/(libc|libm|libpthread|libdl|librt|libresolv)\.so|ld-linux' \
  | while read -r f; do cp -L "$f" "$T/syslibs/$(basename "$f")"; done
find "$T" -name '*.so*' -exec strip --strip-unneeded {} \;
# What engine.so still cannot resolve with the carried folders first (libcuda.so.1 only:
# the driver's, on the GPU machine).
LD_LIBRARY_PATH="$T/lib:$T/syslibs" ldd "$T/site/mooncake/engine.so" | grep 'not found' || true
mkdir -p .whl
tar -C "$T" -cJf .whl/mooncake-cuda.tar.xz .
du -sh "$T" .whl/mooncake-cuda.tar.xz .whl
