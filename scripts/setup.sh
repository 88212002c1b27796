#!/usr/bin/env bash
# Create (or refresh) the project's virtual environment in .venv with the pinned packages of
# requirements.txt and kvstrata itself in editable mode. Idempotent and quick when nothing
# changed: a stamp records the hash of what was installed.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=.venv
STAMP=$VENV/.kvstrata-setup
want=$(cat requirements.txt pyproject.toml src/kvstrata/physical/_copykernel.c | sha256sum | cut -d' ' -f1)

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] && [ -x "$VENV/bin/kvstrata" ]; then
  exit 0
fi

if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating $VENV" >&2
  "$PYTHON" -m venv "$VENV"
fi
echo "setup: installing pinned requirements (torch is the local CPU wheel 2.13.0)" >&2
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -r requirements.txt
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps -e .
echo "$want" > "$STAMP"
