"""The model ladder's bill and accuracy against its top rung alone, in one run.

Two engines of our own, of known quality, loaded by dotted path
(``benchmarks.ladder:KnownEngine``, allowed through
``BATCH_INFERENCE_ENGINE_MODULES``), label tickets whose right label and
difficulty the text carries (``[label=billing]``, ``[hard]``):

* ``cheap`` (rung 1): right on every easy ticket, sure of it (token
  log-probability -0.02); on a hard one unsure (-1.2 to -2.5) and right only
  one time in three;
* ``dear`` (rung 2): right on every ticket, sure of it.

The run: calibrate the ladder on a golden set of ``--golden`` tickets
(``batch-inference calibrate``'s code), then run ``--records`` tickets through
the calibrated cascade and, beside it, through the dear engine alone (a
one-model job of the same records), each with an in-process worker on the
real ledger. Bills are the rungs' prices times the answers each rung gave
(from bi.ladder_answers); accuracies are against the labels in the text and,
for the golden set, what calibrate measured. Goal (issue 38): the cascade's
bill at most half the top rung's, at 98% or more of its accuracy.

``--real N`` adds a two-rung ladder of real models on llama.cpp over the
demo's first N tickets, end to end (calibrate on their true categories,
submit, worker, validate, publish) beside its top rung alone, figures as
they are: SmolLM2-135M then Gemma 3 270M when Gemma's package is installed
(the ``ladder-models`` extra), else SmolLM2 as both rungs (different params),
and the line says which (``real.ladder``).

    python -m benchmarks.ladder [--records N] [--golden G] [--hard-share S] [--real N] [--real-target T]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from batch_inference.engines.base import Engine, Outcome, Request

LABELS = ("billing", "bug", "account", "other")
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"category": {"type": "string", "enum": list(LABELS)}},
    "required": ["category"],
    "additionalProperties": False,
}
KNOWN_ENGINE = "benchmarks.ladder:KnownEngine"
PRICES = {"cheap": 0.0004, "dear": 0.004}     # dollars per record: the dear model at 10x the cheap one
_LABEL = re.compile(r"\[label=(\w+)\]")


def _unit(*parts: str) -> float:
    """A number in [0, 1) fixed by ``parts`` (the same record, the same draw, in every run)."""
    return int(hashlib.sha256("\x1f".join(parts).encode()).hexdigest()[:8], 16) / 2**32


class KnownEngine(Engine):
    """An engine of known quality (see the module docstring). Options: ``quality`` (cheap or dear),
    ``delay_s`` (seconds per record, default 0)."""

    name = "known"
    option_names = frozenset({"quality", "delay_s"})
    serves_models = frozenset({"known-cheap", "known-dear"})
    endpoint = "local"
    gives_logprobs = True

    def __init__(self, spec, options=None):
        super().__init__(spec, options)
        self.quality = str(self.option("quality", "dear"))
        self.delay_s = float(self.option("delay_s", 0.0))

    def load(self) -> None:
        pass

    def answer(self, req: Request) -> tuple[str, float]:
        """(label, log-probability of its tokens) for one ticket."""
        text = req.text or ""
        m = _LABEL.search(text)
        right = m.group(1) if m else "other"
        if self.quality == "dear" or "[hard]" not in text:
            return right, -0.02
        draw = _unit(req.record_id, str(self.spec.params.seed))
        unsure = -1.2 - 1.3 * _unit(req.record_id, "sure")
        if draw < 1 / 3:
            return right, unsure
        wrong = [x for x in LABELS if x != right]
        return wrong[int(draw * 3) % len(wrong)], unsure

    def generate(self, requests: Sequence[Request], stop: threading.Event) -> Iterator[Outcome]:
        for req in requests:
            if stop.is_set():
                return
            if self.delay_s:
                time.sleep(self.delay_s)
            label, lp = self.answer(req)
            head, tail = '{"category": "', '"}'
            tokens = ((head, -0.01), (label, lp), (tail, -0.01))
            yield Outcome(req.record_id, head + label + tail, tokens_out=3,
                          logprobs=tokens if self.want_logprobs else None)


def ticket_rows(n: int, hard_share: float, start: int = 0, prefix: str = "t") -> list[tuple[str, str, str]]:
    """(id, text, right label) of ``n`` tickets; about ``hard_share`` of them hard."""
    rows = []
    for i in range(start, start + n):
        rid = f"{prefix}{i:06d}"
        label = LABELS[int(_unit(rid, "label") * len(LABELS))]
        hard = _unit(rid, "hard") < hard_share
        rows.append((rid, f"Ticket {i}: a customer writes about their account. [label={label}]"
                          f"{' [hard]' if hard else ''}", label))
    return rows


def known_ladder(table: str, golden: str | None, *, delay_s: float = 0.0, target: float = 0.98,
                 thresholds: tuple[float | None, ...] = (None,), **over: Any) -> dict[str, Any]:
    """A ladder spec (as a dict) of the cheap and the dear known engines over ``table``."""
    def rung(quality: str, threshold: float | None) -> dict[str, Any]:
        return {"model": {"name": f"known-{quality}", "digest": hashlib.sha256(quality.encode()).hexdigest()},
                "engine": {"name": KNOWN_ENGINE, "options": {"quality": quality, "delay_s": delay_s}},
                "params": {"temperature": 0, "max_tokens": 16}, "threshold": threshold,
                "cost_per_row": PRICES[quality]}

    d: dict[str, Any] = {
        "dataset": "ladder_bench",
        "source": {"table": table, "id_column": "id", "text_column": "body"},
        "prompt": {"version": "v1", "system": "Label the ticket: billing, bug, account or other."},
        "output_schema": SCHEMA,
        "models": [rung("cheap", thresholds[0]), rung("dear", None)],
        "ladder": {"confidence": "logprobs", "target": target},
        "shard_size": 500, "lease_seconds": 60, "renew_seconds": 5,
    }
    if golden:
        d["evaluation"] = {"golden": {"table": golden, "id_column": "id", "text_column": "body",
                                      "expected_column": "expected"}}
    d.update(over)
    return d


def ticket_tables(conn: Any, rows: list[tuple[str, str, str]], golden: list[tuple[str, str, str]]) -> None:
    """public.tickets (id, body) and public.golden (id, body, expected {category}) from ``ticket_rows``."""
    from psycopg.types.json import Jsonb

    conn.execute("CREATE TABLE public.tickets (id text, body text)")
    conn.execute("CREATE TABLE public.golden (id text, body text, expected jsonb)")
    with conn.cursor() as cur:
        cur.executemany("INSERT INTO public.tickets VALUES (%s, %s)", [(r, t) for r, t, _ in rows])
        cur.executemany("INSERT INTO public.golden VALUES (%s, %s, %s)",
                        [(r, t, Jsonb({"category": label})) for r, t, label in golden])


def _run_job(conn: Any, url: str, spec: Any) -> tuple[str, float]:
    from batch_inference.plan import submit
    from gpu_runner.worker import WorkerConfig, run_worker

    job = submit(conn, spec).job_version
    t0 = time.perf_counter()
    code = run_worker(WorkerConfig(job_version=job, db_url=url, wait_for_leases=False))
    if code != 0:
        raise SystemExit(f"worker exited {code} on {job}")
    return job, time.perf_counter() - t0


def _accuracy(conn: Any, job: str, truth: dict[str, str]) -> float:
    from batch_inference.evaluation import grade
    from batch_inference.status import job_spec

    golden = [{"record_id": r, "expected": {"category": label}} for r, label in truth.items()]
    outputs = {r["record_id"]: r["output"] for r in conn.execute(
        "SELECT record_id, output FROM bi.results WHERE job_version = %s", (job,))}
    return grade(job_spec(conn, job), golden, outputs)["accuracy"]["category"] or 0.0


def _cascade_against_top(conn: Any, url: str, spec: Any, top_spec: Any, truth: dict[str, str]) -> dict[str, Any]:
    """Calibrate ``spec``, run the calibrated cascade and ``top_spec`` (its top rung alone) over the same
    records; the bills, accuracies and times side by side."""
    from batch_inference.ladder.calibrate import calibrate
    from batch_inference.ladder.report import report

    t0 = time.perf_counter()
    cal = calibrate(conn, spec)
    calibrate_s = time.perf_counter() - t0
    job, cascade_s = _run_job(conn, url, cal.spec)
    top_job, top_s = _run_job(conn, url, top_spec)
    rep = report(conn, job)
    top_bill = spec.models[-1].cost_per_row * len(truth)
    acc, top_acc = _accuracy(conn, job, truth), _accuracy(conn, top_job, truth)
    g = cal.report
    return {
        "records": len(truth), "thresholds": cal.thresholds, "job_version": job,
        "cascade": {"bill": round(rep["bill"], 4), "accuracy": round(acc, 4), "seconds": round(cascade_s, 2),
                    "finished_at_rung": [r["kept"] for r in rep["rungs"]]},
        "top_alone": {"bill": round(top_bill, 4), "accuracy": round(top_acc, 4), "seconds": round(top_s, 2)},
        "bill_ratio": round(rep["bill"] / top_bill, 4) if top_bill else None,
        "accuracy_ratio": round(acc / top_acc, 4) if top_acc else None,
        "golden": {"records": g["golden"]["records"], "cascade_accuracy": round(g["picked"]["accuracy"], 4),
                   "top_accuracy": round(g["top_alone"]["accuracy"], 4),
                   "rung_accuracy": [round(r["accuracy"], 4) for r in g["rungs"]],
                   "bill_ratio": round(g["picked"]["bill_share_of_top"], 4), "calibrate_s": round(calibrate_s, 2),
                   "curve_points": len(g["curve"])},
    }


def known(conn: Any, url: str, records: int, golden: int, hard_share: float, target: float) -> dict[str, Any]:
    from batch_inference.spec import parse_spec

    rows = ticket_rows(records, hard_share)
    ticket_tables(conn, rows, ticket_rows(golden, hard_share, prefix="g"))
    spec = parse_spec(known_ladder("public.tickets", "public.golden", shard_size=1000, target=target))
    d = known_ladder("public.tickets", None, shard_size=1000, dataset="ladder_bench_top")
    top = d.pop("models")[-1]
    top_spec = parse_spec({**d, "model": top["model"], "engine": top["engine"], "params": top["params"]})
    out = _cascade_against_top(conn, url, spec, top_spec, {r: label for r, _, label in rows})
    out["hard_share"], out["target"] = hard_share, target
    out["goal_met"] = bool(out["bill_ratio"] is not None and out["bill_ratio"] <= 0.5
                           and out["accuracy_ratio"] is not None and out["accuracy_ratio"] >= 0.98)
    return out


def smollm2_rungs(n_ctx: tuple[int, int] = (1024, 2048)) -> list[dict[str, Any]]:
    """Two rungs of SmolLM2-135M on llama.cpp: rung 1 with a shorter context and answer, priced at a tenth."""
    from batch_inference.engines.llama_cpp import SMOLLM2_GGUF_SHA256

    model = {"name": "SmolLM2-135M-Instruct", "digest": SMOLLM2_GGUF_SHA256}
    return [{"model": model, "engine": {"name": "llama-cpp", "options": {"n_ctx": n_ctx[0]}},
             "params": {"temperature": 0, "max_tokens": 16}, "cost_per_row": 0.0005},
            {"model": model, "engine": {"name": "llama-cpp", "options": {"n_ctx": n_ctx[1]}},
             "params": {"temperature": 0, "max_tokens": 24}, "cost_per_row": 0.005}]


# Rung prices of the real ladder, dollars per record: Gemma 3 270M runs at 0.28-0.6x SmolLM2-135M's speed on
# these cores (docs/evaluation.md, "Which demo model"), so its record is priced at three of SmolLM2's.
REAL_PRICES = {"smollm2": 0.0005, "gemma3": 0.0015}


def real_rungs() -> tuple[list[dict[str, Any]], str]:
    """The real ladder's rungs and their names: SmolLM2-135M (rung 1) then Gemma 3 270M (rung 2) on llama.cpp
    when Gemma's package is installed (the ``ladder-models`` extra), else SmolLM2 as both rungs."""
    from benchmarks.demo_models import gemma3_model

    gemma = gemma3_model()
    if gemma is None:
        return smollm2_rungs(), "SmolLM2-135M x 2 (Gemma 3 270M not installed)"
    small = smollm2_rungs()[0]
    return ([{**small, "cost_per_row": REAL_PRICES["smollm2"]},
             {**gemma, "params": {"temperature": 0, "max_tokens": 16}, "cost_per_row": REAL_PRICES["gemma3"]}],
            "SmolLM2-135M -> Gemma 3 270M")


def real(conn: Any, url: str, records: int, target: float = 0.9) -> dict[str, Any]:
    """The real ladder (``real_rungs``) end to end over the demo's first ``records`` tickets, their true
    categories as the golden set: calibrate, submit, worker, validate, publish; beside it the top rung alone
    over the same records. Times and the load average of each stage."""
    from batch_inference.commands.demo import load_tickets
    from batch_inference.data import DEMO_LABELS_TABLE, DEMO_SOURCE_TABLE, DEMO_SPEC
    from batch_inference.exceptions import InvalidValue
    from batch_inference.publish import publish
    from batch_inference.spec import load_spec, parse_spec
    from batch_inference.status import job_spec
    from batch_inference.validate import validate

    load_tickets(conn, records)
    base = load_spec(DEMO_SPEC)
    g = base.evaluation.golden
    schema = {"type": "object", "properties": {"category": base.output_schema["properties"]["category"]},
              "required": ["category"], "additionalProperties": False}
    d = base.model_dump(mode="json", exclude={"model", "engine", "params", "evaluation", "output_schema", "rules"})
    rungs, ladder_name = real_rungs()
    d.update(dataset="ladder_real", output_schema=schema, category_field="category",
             evaluation={"golden": g.model_dump(mode="json")}, ladder={"target": target})
    d["models"] = rungs
    spec = parse_spec(d)
    top = d["models"][-1]
    td = {k: v for k, v in d.items() if k not in ("models", "ladder")}
    top_spec = parse_spec({**td, "dataset": "ladder_real_top", "model": top["model"], "engine": top["engine"],
                           "params": top["params"]})
    truth = {r["id"]: r["expected"]["category"] for r in conn.execute(f"SELECT id, expected FROM {DEMO_LABELS_TABLE}")}
    ids = {r["id"] for r in conn.execute(f"SELECT id FROM {DEMO_SOURCE_TABLE}")}
    load = [round(os.getloadavg()[0], 1)]
    out: dict[str, Any] = {"ladder": ladder_name, "target": target}
    try:
        out.update(_cascade_against_top(conn, url, spec, top_spec, {k: v for k, v in truth.items() if k in ids}))
    except InvalidValue as exc:
        out["calibrate_refused"] = str(exc)
        return out
    load.append(round(os.getloadavg()[0], 1))
    job = out["job_version"]
    pinned = job_spec(conn, job).models or ()
    out["pinned"] = [{"model": r.model.name, "digest": r.model.digest, "threshold": r.threshold} for r in pinned]
    t0 = time.perf_counter()
    v = validate(conn, job)
    out["validate"] = {"passed": v.passed, "failures": v["failures"], "golden_mode": v["evaluation"]["golden"]["mode"],
                       "golden_accuracy": v["evaluation"]["golden"]["accuracy"], "seconds": round(time.perf_counter() - t0, 2)}
    if v.passed:
        publish(conn, job)
        out["published_rows"] = conn.execute("SELECT count(*) AS n FROM published.ladder_real").fetchone()["n"]
    load.append(round(os.getloadavg()[0], 1))
    out["load1"] = load
    return out


def main(argv: list[str] | None = None) -> int:
    from batch_inference import db
    from batch_inference.engines import ENGINE_MODULES_ENV
    from benchmarks.common import emit, fresh_server, machine

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=5000)
    ap.add_argument("--golden", type=int, default=300)
    ap.add_argument("--hard-share", type=float, default=0.3)
    ap.add_argument("--target", type=float, default=0.99, help="ladder.target calibrate keeps on the golden set "
                    "(a point above the goal's 98%%: a golden set is a sample of the records)")
    ap.add_argument("--real", type=int, default=0, help="also the real ladder (SmolLM2-135M -> Gemma 3 270M, or "
                    "SmolLM2 as both rungs without Gemma) over this many demo tickets")
    ap.add_argument("--real-target", type=float, default=0.9, help="ladder.target of the real ladder's calibrate")
    a = ap.parse_args(argv)
    allowed = [m for m in os.environ.get(ENGINE_MODULES_ENV, "").split(",") if m]
    os.environ[ENGINE_MODULES_ENV] = ",".join([*allowed, "benchmarks.ladder"])
    out: dict[str, Any] = {"benchmark": "ladder", "prices": PRICES}
    with fresh_server() as url, db.connect(url) as conn:
        out["known"] = known(conn, url, a.records, a.golden, a.hard_share, a.target)
    if a.real:
        with fresh_server() as url, db.connect(url) as conn:
            out["real"] = real(conn, url, a.real, a.real_target)
    k = out["known"]
    out["target"] = "cascade bill <= 50% of the top rung's at >= 98% of its accuracy (engines of known quality)"
    out["met"] = k["goal_met"]
    out["quick"] = (f"cascade bill {k['bill_ratio']:.1%} of the top rung's at {k['accuracy_ratio']:.1%} of its "
                    f"accuracy (goal <= 50% at >= 98%: {'met' if k['goal_met'] else 'NOT met'})")
    out["machine"] = machine()
    emit(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
