#!/usr/bin/env bash
# One entry point for a fresh machine: creates or reuses .venv, installs pinned dependencies, then runs.
#   ./dev.sh recall [ARGS]   the main job: `dsakit recall` (default needle sweep)
#   ./dev.sh test [ARGS]     the full CPU test suite (Triton kernels under TRITON_INTERPRET=1)
#   ./dev.sh dsakit [ARGS]   any other dsakit subcommand
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"

PY=${PYTHON:-$(command -v python3.11 || command -v python3)}
VENV=.venv
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
stamp="$VENV/.dsakit-installed"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ dev.sh -nt "$stamp" ]; then
  # Exact pins live here, not in pyproject (which keeps ranges so dsakit installs beside a user's CUDA
  # torch). torch 2.13.0 is the CPU build on our machines; triton 3.6.0 matches the H200 image.
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check "torch==2.13.0" "triton==3.6.0"
  # transformers: tests (conformance with its DeepseekV4Indexer) and the optional `serve` extra (dsakit serve,
  # the tiny model's training); pinned so that CI does not drift with its releases.
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check "transformers==5.24.0"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check -e ".[test,serve]"
  touch "$stamp"
fi

cmd=${1:-test}
shift || true
case "$cmd" in
  recall) exec "$VENV/bin/dsakit" recall "$@" ;;
  test)   export TRITON_INTERPRET=1
          exec "$VENV/bin/python" -m pytest -n 2 -q "$@" ;;
  dsakit) exec "$VENV/bin/dsakit" "$@" ;;
  *) echo "usage: ./dev.sh recall|test|dsakit [ARGS]" >&2; exit 2 ;;
esac
