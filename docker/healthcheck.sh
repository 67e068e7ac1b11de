#!/usr/bin/env bash
# Docker HEALTHCHECK: healthy once the model is loaded (GET /ready answers 200).
set -euo pipefail
exec python3 - <<'PY'
import os, sys, urllib.request
url = f"http://127.0.0.1:{os.environ.get('GLM53_PORT', '30000')}/ready"
try:
    with urllib.request.urlopen(url, timeout=4) as r:
        sys.exit(0 if r.status == 200 else 1)
except Exception:
    sys.exit(1)
PY
