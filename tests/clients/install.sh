#!/usr/bin/env bash
# Install the real agent CLIs the client tests drive (versions pinned in tests/clients/clients.json) into
# .clients/ at the repository root. Without npm it says so and does nothing (the tests then skip, or fail in CI).
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
dest="$root/.clients"
if ! command -v npm >/dev/null 2>&1; then
  echo "clients: npm not found; the real-client tests will not run (install Node.js and npm)"
  exit 0
fi
mapfile -t specs < <(python3 -c 'import json,sys; [print(f"{k}@{v}") for k, v in json.load(open(sys.argv[1])).items()]' \
  "$root/tests/clients/clients.json")
if [ -f "$dest/.installed" ] && [ "$(cat "$dest/.installed")" = "${specs[*]}" ]; then
  exit 0
fi
echo "clients: installing ${specs[*]} into .clients/"
mkdir -p "$dest"
npm install --prefix "$dest" --no-audit --no-fund --loglevel=error "${specs[@]}"
echo "${specs[*]}" > "$dest/.installed"
