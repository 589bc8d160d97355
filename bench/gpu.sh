#!/usr/bin/env bash
# From a bare GPU machine to bench.gpu's figures in one call.
#
#   bench/gpu.sh [bench.gpu flags]        # e.g. on the device tool: OUT=... bench/gpu.sh
#
# The machine has torch with CUDA, grpcio and the rest of a data-science image, but no
# Horovod, maybe no iproute2, and no network. What it lacks comes from the carry folder
# ($CROSSOVER_GPU_CARRY, default .gpu-carry/) that scripts/gpu_carry.sh fills on a machine
# with network:
#   wheels/            the Python packages at the versions the project pins
#   horovod/           Horovod built for that machine's Python and torch (a site folder), else
#   horovod-*.tar.gz   its sdist, built here with Gloo and CUDA (minutes)
#   debs/              iproute2 and its libraries, used only where `ip` or `tc` is missing
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
CARRY="${CROSSOVER_GPU_CARRY:-$ROOT/.gpu-carry}"
PY="${PYTHON:-python3}"
SITE="$(mktemp -d /tmp/xo-gpu-site.XXXXXX)"
log() { printf '[bench/gpu.sh %s] %s\n' "$(date +%T)" "$*" >&2; }
start=$SECONDS

if compgen -G "$CARRY/wheels/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --disable-pip-version-check --target "$SITE" \
    "$CARRY"/wheels/*.whl
fi
export PYTHONPATH="$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}"

if ! "$PY" -c 'import horovod.torch' 2>/dev/null; then
  if [ -d "$CARRY/horovod/horovod" ]; then
    log "Horovod from $CARRY/horovod"
    export PYTHONPATH="$CARRY/horovod:$PYTHONPATH"
  elif SDIST="$(compgen -G "$CARRY/horovod-*.tar.gz" | head -n1)"; then
    log "building Horovod from $SDIST (Gloo, CUDA staging through host memory)"
    WORK="$(mktemp -d)"
    tar -xzf "$SDIST" -C "$WORK"
    SRC="$(echo "$WORK"/horovod-*)"
    # PyTorch >= 2.1 headers need C++17 (upstream horovod PR #3998); CUDA 13 drops C++11.
    sed -i 's/CMAKE_CXX_STANDARD 14/CMAKE_CXX_STANDARD 17/' "$SRC/CMakeLists.txt" "$SRC/horovod/torch/CMakeLists.txt"
    sed -i 's/CMAKE_CUDA_STANDARD 11/CMAKE_CUDA_STANDARD 17/' "$SRC/horovod/common/ops/cuda/CMakeLists.txt"
    CC_LIST="$("$PY" -c 'import torch; p = torch.cuda.get_device_capability(); print(f"{p[0]}{p[1]}")')"
    CUDA_HOME="${CUDA_HOME:-$(dirname "$(dirname "$(command -v nvcc)")")}" \
    HOROVOD_BUILD_CUDA_CC_LIST="$CC_LIST" HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 \
    HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 MAKEFLAGS="-j$(nproc)" \
      "$PY" -m pip install -q --no-deps --no-build-isolation --no-compile --target "$SITE" "$SRC"
  else
    log "error: no Horovod here and none in $CARRY (run scripts/gpu_carry.sh where there is network)"
    exit 2
  fi
fi

if ! command -v ip >/dev/null || ! command -v tc >/dev/null; then
  if ! compgen -G "$CARRY/debs/*.deb" >/dev/null; then
    log "error: no ip/tc here and no iproute2 in $CARRY/debs"
    exit 2
  fi
  log "iproute2 from $CARRY/debs"
  mkdir -p "$SITE/iproute2" "$SITE/bin"
  for deb in "$CARRY"/debs/*.deb; do dpkg -x "$deb" "$SITE/iproute2"; done
  LIBS="$SITE/iproute2/usr/lib/x86_64-linux-gnu:$SITE/iproute2/lib/x86_64-linux-gnu"
  for tool in ip tc; do
    printf '#!/bin/sh\nLD_LIBRARY_PATH=%s exec %s "$@"\n' "$LIBS" "$(compgen -G "$SITE/iproute2/*bin/$tool" | head -n1)" \
      >"$SITE/bin/$tool"
    chmod +x "$SITE/bin/$tool"
  done
  export PATH="$SITE/bin:$PATH"
fi
log "set-up took $((SECONDS - start)) s"
cd "$ROOT"
exec "$PY" -m bench.gpu "$@"
