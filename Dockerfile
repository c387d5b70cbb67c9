# GPU runner image: the batch-inference worker with the vllm engine.
#
#   docker build -t batch-inference-gpu .
#   docker run --gpus all -v /models/qwen:/models/qwen:ro \
#       -e BATCH_INFERENCE_DB=postgresql://... batch-inference-gpu JOB_VERSION
#
# Not built in CI here (no Docker engine on these machines).

# The official vLLM image already carries a CUDA runtime, PyTorch and vLLM
# built for each other; installing vLLM ourselves would mean choosing those
# versions by hand. The tag is pinned so a rebuild cannot change the engine
# under a running job version (and so results): bump it deliberately. For
# fully reproducible builds, pin by digest as well (vllm/vllm-openai:v0.32.0@sha256:...).
ARG VLLM_IMAGE=vllm/vllm-openai:v0.32.0
FROM ${VLLM_IMAGE}

# Weights are mounted read-only at runtime and pinned by digest in the job
# spec, so the image never downloads models (offline hub), never phones
# home (usage stats), and writes Python output unbuffered so preemption
# logs reach the pod log before the process dies.
ENV HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    VLLM_NO_USAGE_STATS=1 \
    DO_NOT_TRACK=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /opt/batch-inference/src

# Only what the wheel is built from (pyproject names README.md and force-
# includes sql/); tests, DAGs and docs stay out of the runner.
COPY pyproject.toml README.md ./
COPY plugins ./plugins
COPY gpu_runner ./gpu_runner
COPY sql ./sql

# Install this package with the vllm extra, every version fixed:
# * the base constraints freeze every distribution the base image already
#   has (vLLM, torch, pydantic, ...) at its installed version, so pip can
#   never upgrade or replace vLLM's stack;
# * docker/runner-pins.txt pins what pip adds (psycopg, SQLAlchemy, ...,
#   and the build backend), keeping only the pins for names the base lacks,
#   so the two lists never conflict;
# * the build backend is installed pinned first and the wheel is built
#   without build isolation, which would fetch an unpinned hatchling.
# No [airflow] extra: the runner does not import Airflow.
COPY docker/runner-pins.txt /tmp/runner-pins.txt
RUN python3 -m pip list --format=freeze > /tmp/base-constraints.txt \
 && python3 -c "import re; name = lambda l: re.split(r'[=<>!~@ ;]', l.strip(), maxsplit=1)[0].lower().replace('_', '-').replace('.', '-'); lines = lambda p: [l.strip() for l in open(p) if l.strip() and not l.startswith(('#', '-'))]; base = {name(l) for l in lines('/tmp/base-constraints.txt')}; print('\\n'.join(l for l in lines('/tmp/runner-pins.txt') if name(l) not in base))" > /tmp/added-pins.txt \
 && PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install --constraint /tmp/base-constraints.txt \
        --constraint /tmp/added-pins.txt hatchling \
 && PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install --no-build-isolation \
        --constraint /tmp/base-constraints.txt --constraint /tmp/added-pins.txt ".[vllm]" \
 && rm -rf /tmp/base-constraints.txt /tmp/added-pins.txt /tmp/runner-pins.txt /opt/batch-inference/src \
 && python3 -c "import vllm, batch_inference.engines.vllm, gpu_runner.worker"

# A non-root user: the worker needs no privileges, only the GPU device the
# runtime passes in and a writable home for vLLM's compile cache.
RUN useradd --create-home --uid 10001 --shell /usr/sbin/nologin runner
USER 10001
WORKDIR /home/runner

# One worker per pod; arguments after the image name go to the worker
# (the job version and options). No HEALTHCHECK: the lease in PostgreSQL
# is the liveness signal, and the orchestrator restarts exited pods.
ENTRYPOINT ["batch-inference", "worker"]
