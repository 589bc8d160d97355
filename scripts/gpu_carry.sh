#!/usr/bin/env bash
# Fill the carry folder that bench/gpu.sh reads on a GPU machine without network.
#
#   scripts/gpu_carry.sh [--build]     # here, where PyPI and Debian's packages are reachable
#
# The target (the device tool's machines): x86-64, Python 3.12, torch 2.11.0 with CUDA 13.0.
# Override with GPU_PYTHON_VERSION and GPU_TORCH. Writes $CROSSOVER_GPU_CARRY (default .gpu-carry/,
# which .git/info/exclude should list):
#   wheels/            grpcio, grpcio-health-checking, protobuf at requirements-dev.txt's versions, cffi
#   horovod-*.tar.gz   Horovod's sdist (bench/gpu.sh builds it there when horovod/ is absent: minutes)
#   debs/              iproute2 and the libraries it needs beyond a base image
#   horovod/           with --build: Horovod built here for the target's Python and torch (Gloo, CUDA
#                      staging through host memory), debug info stripped, ready to go on PYTHONPATH.
#                      Needs a CUDA toolkit matching the target's torch (nvcc on PATH) and that
#                      Python (pyenv); it downloads the target's torch and its CUDA libraries (GBs).
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
CARRY="${CROSSOVER_GPU_CARRY:-$ROOT/.gpu-carry}"
PYV="${GPU_PYTHON_VERSION:-3.12}"
TORCH="${GPU_TORCH:-2.11.0}"
HOROVOD_VERSION=0.28.1
log() { printf '[gpu_carry] %s\n' "$*" >&2; }
cuda_home() {  # the toolkit with the runtime's headers; nvcc on PATH may be a wrapper outside it
  for d in "${CUDA_HOME:-}" /usr/local/cuda /usr/local/cuda-*; do
    if [ -n "$d" ] && [ -f "$d/include/cuda_runtime_api.h" ]; then echo "$d"; return; fi
  done
  dirname "$(dirname "$(command -v nvcc)")"
}
pin() { grep -E "^$1==" "$ROOT/requirements-dev.txt" | head -n1; }

mkdir -p "$CARRY/wheels" "$CARRY/debs"
PIP=(python3 -m pip download -q --no-deps --disable-pip-version-check)
PLAT=(--only-binary=:all: --python-version "$PYV" --implementation cp --platform manylinux_2_28_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any)
PROTOBUF="$(python3 -c 'import google.protobuf as p; print(p.__version__)' 2>/dev/null || echo 7.36.2)"
log "wheels for Python $PYV"
"${PIP[@]}" "${PLAT[@]}" -d "$CARRY/wheels" "$(pin grpcio)" "$(pin grpcio-health-checking)" \
  "protobuf==$PROTOBUF" cffi pycparser
log "Horovod $HOROVOD_VERSION sdist"
"${PIP[@]}" --no-binary=:all: -d "$CARRY" "horovod==$HOROVOD_VERSION"
log "iproute2"
(cd "$CARRY/debs" && apt-get download iproute2 libbpf1 libelf1 libmnl0 libxtables12 libcap2 2>/dev/null)

if [ "${1:-}" = "--build" ]; then
  PY="${GPU_PYTHON:-python$PYV}"
  if ! "$PY" -c '' 2>/dev/null && command -v pyenv >/dev/null; then  # a pyenv shim of a version not selected
    PY="$(pyenv root)/versions/$(pyenv versions --bare | grep -m1 "^$PYV\.")/bin/python$PYV"
  fi
  VENV="$(mktemp -d)/venv"
  "$PY" -m venv "$VENV"
  log "torch $TORCH and its CUDA libraries into $VENV (for the headers and a working import)"
  "$VENV/bin/pip" install -q "torch==$TORCH" cmake wheel "setuptools<82" packaging pyyaml psutil cloudpickle cffi
  WORK="$(mktemp -d)"
  tar -xzf "$CARRY/horovod-$HOROVOD_VERSION.tar.gz" -C "$WORK"
  SRC="$WORK/horovod-$HOROVOD_VERSION"
  sed -i 's/CMAKE_CXX_STANDARD 14/CMAKE_CXX_STANDARD 17/' "$SRC/CMakeLists.txt" "$SRC/horovod/torch/CMakeLists.txt"
  sed -i 's/CMAKE_CUDA_STANDARD 11/CMAKE_CUDA_STANDARD 17/' "$SRC/horovod/common/ops/cuda/CMakeLists.txt"
  log "building Horovod for sm_${GPU_CC:-90} (about 2.5 minutes on 2 cores)"
  CUDA_HOME="$(cuda_home)" PATH="$(cuda_home)/bin:$PATH" \
  HOROVOD_BUILD_CUDA_CC_LIST="${GPU_CC:-90}" HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 \
  HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 MAKEFLAGS="-j$(nproc)" \
    "$VENV/bin/pip" wheel -q --no-deps --no-build-isolation -w "$WORK/wheel" "$SRC"
  rm -rf "$CARRY/horovod"
  "$VENV/bin/pip" install -q --no-deps --no-compile --target "$CARRY/horovod" "$WORK"/wheel/horovod-*.whl
  rm -rf "$CARRY/horovod/bin"
  find "$CARRY/horovod" -name '*.so' -exec strip --strip-debug {} \;
fi
du -sh "$CARRY" >&2
