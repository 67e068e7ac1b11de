#!/usr/bin/env bash
# Download, for the GPU machine (Python 3.12, no network), the wheels the server suites need beyond the device
# bundle (fastapi, uvicorn, the openai client, ...), with their dependencies resolved for that Python, into
# .device-cache/extra. On the GPU machine, after `source .device-cache/setup.sh`:
#   pip install -q --no-index --no-deps --target /tmp/site-extra .device-cache/extra/*.whl
#   export PYTHONPATH=$PYTHONPATH:/tmp/site-extra
#   GLM53_TEST_ENGINE=exl3 python3 -m pytest -q tests/server/test_server_conformance.py
set -euo pipefail
root=$(git rev-parse --show-toplevel)
dest="$root/.device-cache/extra"
mkdir -p "$dest"
# torch, numpy, pydantic and transformers come from the GPU image or the bundle: never shadow them.
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  -d "$dest" fastapi "uvicorn[standard]" openai prometheus-client xxhash python-dotenv py-cpuinfo hypothesis \
  httpx pyyaml jsonschema anthropic pillow
rm -f "$dest"/torch-* "$dest"/numpy-* "$dest"/pydantic-* "$dest"/pydantic_core-* "$dest"/transformers-* \
  "$dest"/nvidia_* "$dest"/triton-*
du -sh "$dest"
