# Sourced by demo.sh and test.sh: create and fill the project's own virtual
# environment (.venv) on first use; later runs reuse it and only re-install
# the project itself. llama-cpp-python builds from source the first time
# (about 5 minutes on 2 cores); pip caches the wheel afterwards.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
STAMP=.venv/.installed-$(sha256sum pyproject.toml | cut -c1-16)
if [ ! -f "$STAMP" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e ".[dev]"
  touch "$STAMP"
fi
export PATH="$ROOT/.venv/bin:$PATH"
