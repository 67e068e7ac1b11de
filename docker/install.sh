#!/usr/bin/env bash
# Install glm53 and what it needs into the Python environment given as $1 (default: python3 on PATH).
# Used by `make` (into .venv: serving needs only the base install, `make test` adds the dev extras) and so by CI.
# The Dockerfile installs the same requirements (docker/deps.py reads them from pyproject.toml) before it copies
# the source, so that a source edit does not redo the downloads.
#   docker/install.sh [PYTHON] [EXTRAS]      e.g. docker/install.sh .venv/bin/python dev
# Torch: a CPU build where there is no NVIDIA driver, else the CUDA build PyPI serves; TORCH_SPEC (and
# TORCH_INDEX, the index for a CPU build) override. The line "install: torch... from ..." says which index.
set -euo pipefail
python=${1:-python3}
extras=${2:-}
root=$(cd "$(dirname "$0")/.." && pwd)
# On a terminal pip shows its own progress (a first install downloads about a gigabyte); in logs it stays quiet.
quiet=(-q)
[ -t 1 ] && quiet=()
pip=("$python" -m pip install --disable-pip-version-check "${quiet[@]}")

if [ -z "${TORCH_SPEC:-}" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    TORCH_SPEC="torch>=2.6"
  else
    TORCH_SPEC="torch==2.13.0"   # enough for the demo and tests
    # PyPI's Linux wheel of torch is the CUDA build (several GB of libraries): take the CPU build from
    # PyTorch's own index; a machine that cannot reach it (an offline mirror) uses its configured one.
    TORCH_INDEX=${TORCH_INDEX:-https://download.pytorch.org/whl/cpu}
  fi
fi
if ! "$python" -c "import torch" >/dev/null 2>&1; then
  # Decide the index once, with one short probe: pip itself would retry an unreachable index for minutes,
  # printing a "Retrying" warning each time, before anything could fall back.
  index=()
  from="the configured index (${PIP_INDEX_URL:-pip.conf or PyPI})"
  if [ -n "${TORCH_INDEX:-}" ]; then
    if "$python" - "$TORCH_INDEX" >/dev/null 2>&1 <<'PY'
import sys
import urllib.request

urllib.request.urlopen(sys.argv[1].rstrip("/") + "/torch/", timeout=5).close()
PY
    then
      index=(--index-url "$TORCH_INDEX")
      from=$TORCH_INDEX
    else
      from="$from, as $TORCH_INDEX is not reachable from here"
    fi
  fi
  echo "install: $TORCH_SPEC from $from"
  "${pip[@]}" "${index[@]}" "$TORCH_SPEC"
fi
target="$root"
[ -n "$extras" ] && target="${root}[${extras}]"
echo "install: glm53${extras:+[$extras]}"
"${pip[@]}" -e "$target"
