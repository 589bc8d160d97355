#!/usr/bin/env bash
# Bring a fresh machine to the point where `make demo` and `make test` run:
# Debian's OpenMPI and iproute2, a project virtualenv, PyTorch, Horovod 0.28.1
# (built once from its sdist with the C++17 fix, then cached as a wheel outside
# the checkout), and Crossover itself. Idempotent: a second run takes seconds.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${CROSSOVER_VENV:-$ROOT/.venv}"
CACHE="${CROSSOVER_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/crossover/wheels}"
PY="${PYTHON:-python3}"
HOROVOD_VERSION=0.28.1
TORCH_VERSION=2.13.0

log() { printf '[bootstrap] %s\n' "$*" >&2; }

need_apt=()
command -v mpirun >/dev/null 2>&1 || need_apt+=(openmpi-bin)
[ -e /usr/include/x86_64-linux-gnu/openmpi ] || [ -e /usr/lib/x86_64-linux-gnu/openmpi/include ] || dpkg -s libopenmpi-dev >/dev/null 2>&1 || need_apt+=(libopenmpi-dev)
command -v tc >/dev/null 2>&1 || need_apt+=(iproute2)
command -v cmake >/dev/null 2>&1 || need_apt+=(cmake)
command -v systemd-analyze >/dev/null 2>&1 || need_apt+=(systemd)  # verifies deploy/systemd in make test
if [ ${#need_apt[@]} -gt 0 ]; then
  log "installing Debian packages: ${need_apt[*]}"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

# A torch already importable by the interpreter (a user's CUDA build) is kept:
# the virtualenv then sees the system site-packages instead of installing ours.
SYSTEM_TORCH="$("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null || true)"
if [ ! -x "$VENV/bin/python" ]; then
  if [ -n "$SYSTEM_TORCH" ]; then
    log "creating $VENV (sharing the system torch $SYSTEM_TORCH)"
    "$PY" -m venv --system-site-packages "$VENV"
  else
    log "creating $VENV"
    "$PY" -m venv "$VENV"
  fi
fi
VPY="$VENV/bin/python"
# pip byte-compiles each package on one core; compileall below does all of them on every core, once.
PIP=("$VPY" -m pip install -q --disable-pip-version-check --no-compile)
# Byte-compiled here, or never: where PYTHONDONTWRITEBYTECODE is set (as on CI) every process, the
# checks below included, would compile torch from source at each import. On every core; what is
# already compiled is skipped; packages' own test folders are left out; files pip would not compile
# either (templates) fail quietly.
compile_site() {
  "$VPY" -m compileall -q -j 0 -x '/tests?/' \
    "$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" >/dev/null 2>&1 || true
}

if ! "$VPY" -c 'import torch' 2>/dev/null; then
  log "installing torch==$TORCH_VERSION (CPU build)"
  "${PIP[@]}" "torch==$TORCH_VERSION"
fi
compile_site
# The test and tooling wheels (and Horovod's own dependencies) are downloaded once into a wheelhouse
# beside the Horovod wheel, keyed by the requirements, and installed from there without the network.
PYTAG="$("$VPY" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')"
DEPS="$CACHE/deps-$PYTAG-$(cat "$ROOT/requirements-dev.txt" | sha256sum | cut -c1-12)"
HOROVOD_DEPS=(cloudpickle psutil pyyaml packaging cffi)
if [ ! -e "$DEPS/.complete" ]; then
  log "downloading the test and tooling wheels once (cached in $DEPS)"
  mkdir -p "$DEPS"
  "$VPY" -m pip download -q --disable-pip-version-check -d "$DEPS" -r "$ROOT/requirements-dev.txt" \
    "${HOROVOD_DEPS[@]}" && touch "$DEPS/.complete"
fi
"${PIP[@]}" --no-index --find-links "$DEPS" -r "$ROOT/requirements-dev.txt" \
  || "${PIP[@]}" -r "$ROOT/requirements-dev.txt"  # a wheelhouse gone stale: the index, as before

# torchvision, for Horovod's own examples in the conformance tier. PyPI has no CPU build:
# its wheel requires the CUDA torch, so it goes in without dependencies, at the version
# that pins this torch (its compiled ops then do not load; tests/conformance/with_crossover.py
# copes). Checked by presence, not by import, since that import fails beside a CPU torch.
if ! "$VPY" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("torchvision") is None)'; then
  TORCH_NOW="$("$VPY" -c 'import torch; print(torch.__version__.split("+")[0])')"
  case "$TORCH_NOW" in
    2.13.*)
      log "installing torchvision==0.28.0 without dependencies (for torch $TORCH_NOW)"
      "${PIP[@]}" --no-deps "torchvision==0.28.0" ;;
    *)
      log "skipping torchvision: no known version for torch $TORCH_NOW (tests/conformance/test_peer_examples.py needs it)" ;;
  esac
fi

if ! "$VPY" -c 'import horovod.torch' 2>/dev/null; then
  TORCH_TAG="$("$VPY" -c 'import torch; print(torch.__version__.replace("+", "_"))')"
  CUDA="$("$VPY" -c 'import torch; print("cuda" if torch.version.cuda else "cpu")')"
  KEY="$CACHE/$PYTAG-torch$TORCH_TAG-$CUDA"
  WHEEL="$(ls "$KEY"/horovod-"$HOROVOD_VERSION"-*.whl 2>/dev/null | head -n1 || true)"
  if [ -z "$WHEEL" ]; then
    log "building Horovod $HOROVOD_VERSION from its sdist (about 3-5 minutes; cached in $KEY)"
    WORK="$(mktemp -d)"; trap 'rm -rf "$WORK"' EXIT
    "$VPY" -m pip download -q --no-deps --no-binary=:all: "horovod==$HOROVOD_VERSION" -d "$WORK"
    tar -xzf "$WORK"/horovod-"$HOROVOD_VERSION".tar.gz -C "$WORK"
    SRC="$WORK/horovod-$HOROVOD_VERSION"
    # Upstream fix (horovod PR #3998): PyTorch >= 2.1 headers need C++17.
    sed -i 's/CMAKE_CXX_STANDARD 14/CMAKE_CXX_STANDARD 17/' "$SRC/CMakeLists.txt" "$SRC/horovod/torch/CMakeLists.txt"
    "${PIP[@]}" cmake wheel setuptools
    export HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITH_MPI=1
    export HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1
    if [ "$CUDA" = cuda ]; then export HOROVOD_GPU_OPERATIONS=NCCL; fi
    export MAKEFLAGS="-j$(nproc)"
    mkdir -p "$KEY"
    "$VPY" -m pip wheel -q --no-deps --no-build-isolation -w "$KEY" "$SRC"
    WHEEL="$(ls "$KEY"/horovod-"$HOROVOD_VERSION"-*.whl | head -n1)"
  else
    log "using cached Horovod wheel $WHEEL"
  fi
  "${PIP[@]}" --no-deps "$WHEEL"
  "${PIP[@]}" --no-index --find-links "$DEPS" "${HOROVOD_DEPS[@]}" || "${PIP[@]}" "${HOROVOD_DEPS[@]}"
fi

"${PIP[@]}" --no-deps -e "$ROOT"
compile_site
log "ready: $VENV ($("$VPY" -c 'import torch, horovod; print("torch", torch.__version__, "horovod", horovod.__version__)'))"
