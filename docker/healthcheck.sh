#!/usr/bin/env bash
# Docker HEALTHCHECK: healthy once the model is loaded (GET /ready answers 200), on the port actually served:
# `glm53 serve` writes it to /run/glm53/port (so `serve --port 8000` is followed), else GLM53_PORT.
set -euo pipefail
exec python3 - <<'PY'
import os, sys, urllib.request
try:
    port = open("/run/glm53/port").read().strip()
except OSError:
    port = os.environ.get("GLM53_PORT", "30000")
try:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=4) as r:
        sys.exit(0 if r.status == 200 else 1)
except Exception:
    sys.exit(1)
PY
