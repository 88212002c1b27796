#!/usr/bin/env bash
# Create (or refresh) .venv-peers: the peers' own code that bench/ scripts measure kvstrata
# against (Dynamo's router in Rust: block hashing and RadixTree). Separate from .venv because
# its pins conflict with vLLM's. Idempotent: a stamp records the hash of what was installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=.venv-peers
STAMP=$VENV/.kvstrata-peers
want=$(sha256sum requirements-peers.txt | cut -d' ' -f1)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
  exit 0
fi
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -r requirements-peers.txt
echo "$want" > "$STAMP"
