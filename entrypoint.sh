#!/usr/bin/env bash
# Container entrypoint. It only dispatches; every decision (mode, tier sizes, refusals) is made in Python
# by `glm53 plan`, so what the container does can be reproduced with `python -m glm53 ...` on the host.
#   entrypoint.sh [serve|plan|preflight|pack-store|verify-store|bench|settings|model|fixture] [ARGS...]
#   entrypoint.sh CMD ARGS...   anything else is exec'd as is (e.g. bash)
set -euo pipefail
python=${GLM53_PYTHON:-python3}

if [ $# -eq 0 ]; then
  set -- serve
fi
case "$1" in
  serve|plan|preflight|pack-store|verify-store|bench|settings|model|fixture)
    exec "$python" -m glm53 "$@"
    ;;
  -*)
    # Flags alone mean flags to serve (docker run IMAGE --port 8000).
    exec "$python" -m glm53 serve "$@"
    ;;
  *)
    exec "$@"
    ;;
esac
