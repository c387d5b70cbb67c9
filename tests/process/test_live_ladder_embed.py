"""A model ladder and an embedding job as deployed: the backfill DAG of the live Airflow deployment
(tests/fixtures/live_airflow.py) runs each through estimate, submit, the workers task's processes,
validate and publish, driven through the REST API; the ledger is read over SQL. Real engines: SmolLM2
on llama.cpp as both rungs, and the same GGUF in llama.cpp's embedding mode."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from batch_inference import db
from batch_inference.data import DEMO_SPEC
from batch_inference.engines.llama_cpp import SMOLLM2_GGUF_SHA256
from benchmarks.ladder import smollm2_rungs
from tests.process.test_live_airflow import BACKFILL, counts, make_table, published_rows

pytestmark = pytest.mark.live

CATEGORY_ONLY = {"type": "object",
                 "properties": {"category": {"type": "string",
                                             "enum": ["billing", "bug", "account", "feature_request", "other"]}},
                 "required": ["category"], "additionalProperties": False}


def write_spec(dep: Any, dataset: str, drop: tuple[str, ...], **over: Any) -> str:
    """The demo spec without ``drop`` and with ``over``, written beside the deployment."""
    spec = yaml.safe_load(Path(DEMO_SPEC).read_text())
    for key in drop:
        spec.pop(key, None)
    spec.update(dataset=dataset, **over)
    path = Path(dep.home) / f"{dataset}.yaml"
    # Through JSON: a dict used twice (the rungs' one model) would be a YAML alias, which specs refuse.
    path.write_text(yaml.safe_dump(json.loads(json.dumps(spec)), sort_keys=False))
    return str(path)


def run_backfill(dep: Any, spec: str, table: str, **conf: Any) -> tuple[str, str, float]:
    """Trigger the backfill DAG, wait for success: (run id, job version, seconds)."""
    t0 = time.monotonic()
    run_id = dep.trigger(BACKFILL, {"spec_path": spec, "source_table": table, "deadline": "+20h", **conf})
    run = dep.wait_run(BACKFILL, run_id, timeout=600)
    assert run["state"] == "success", dep.explain(BACKFILL, run_id)
    return run_id, dep.xcom(BACKFILL, run_id, "submit")["job_version"], time.monotonic() - t0


def test_a_two_rung_smollm2_ladder_runs_through_the_deployment(live_airflow):
    """SmolLM2-135M as both rungs (rung 1: a shorter context and answer, token log-probabilities as
    its confidence). Its label probabilities under the grammar are low (docs/ladder.md), so with
    threshold 0.9 rung 1's answers go on to rung 2 and are kept for audit."""
    dep = live_airflow
    table = make_table(dep.ledger_url, "live_ladder", 4)
    rungs = smollm2_rungs(n_ctx=(512, 1024))
    rungs[0]["threshold"] = 0.9
    for r in rungs:
        r["engine"]["options"]["n_threads"] = 1
    spec = write_spec(dep, "live_ladder", ("model", "engine", "params"), output_schema=CATEGORY_ONLY,
                      models=rungs, ladder={"confidence": "logprobs"})
    run_id, job, took = run_backfill(dep, spec, table, shard_size=2, workers=2)
    c = counts(dep, job)
    assert c["status"] == "published" and c["outstanding"] == 0
    assert c["stored"] + c["dead_letters"] == c["records"] == 4 and c["stored"] >= 3
    assert published_rows(dep, "live_ladder") == c["stored"]
    with db.connect(dep.ledger_url) as conn:
        results = {r["record_id"]: r for r in conn.execute(
            "SELECT record_id, output, engine, worker_id FROM bi.results WHERE job_version = %s", (job,))}
        answers = conn.execute("SELECT record_id, rung, output, confidence, escalated FROM bi.ladder_answers "
                               "WHERE job_version = %s ORDER BY record_id, rung", (job,)).fetchall()
        dupes = conn.execute("SELECT count(*) - count(DISTINCT record_id) AS d FROM bi.results WHERE job_version = %s",
                             (job,)).fetchone()["d"]
    assert dupes == 0 and {r["engine"] for r in results.values()} == {"ladder"}
    by_record: dict[str, list[dict[str, Any]]] = {}
    for a in answers:
        by_record.setdefault(a["record_id"], []).append(a)
    finals = {}
    for rid, row in results.items():
        rows = by_record[rid]
        (final,) = [a for a in rows if not a["escalated"]]                 # written once, naming its rung
        assert yaml.safe_load(final["output"]) == row["output"]            # the stored result is that answer
        assert [a["rung"] for a in rows] == list(range(1, final["rung"] + 1))   # lower rungs kept for audit
        finals[rid] = final["rung"]
    audit = [a for a in answers if a["escalated"]]
    assert audit and all(a["rung"] == 1 and a["confidence"] is not None and a["confidence"] < 0.9 for a in audit)
    print(f"ladder as deployed: 4 records, trigger to published {took:.1f} s; finals by rung "
          f"{sorted(finals.values())}; rung-1 confidences {[round(a['confidence'], 4) for a in audit]}")


def _nearest(conn: Any, dataset: str, record_id: str, k: int = 3) -> list[dict[str, Any]]:
    return conn.execute(
        f"SELECT record_id, job_version FROM published.{dataset} ORDER BY embedding <=> "
        f"(SELECT embedding FROM published.{dataset} WHERE record_id = %s) LIMIT %s", (record_id, k)).fetchall()


def test_an_embedding_job_publishes_a_searchable_view_and_a_rollback_moves_it_back(live_airflow):
    dep = live_airflow
    dataset = "live_vectors"
    table = make_table(dep.ledger_url, "live_vectors", 8)
    drop = ("engine", "params", "output_schema", "category_field", "evaluation")
    base = {"task": "embed", "model": {"name": "SmolLM2-135M-Instruct-Q4_1", "digest": SMOLLM2_GGUF_SHA256},
            "engine": {"name": "llama-cpp", "options": {"n_threads": 1}}}
    spec = write_spec(dep, dataset, drop, **base, prompt={"version": "e1", "template": "{text}"},
                      embedding={"dimensions": 576, "instruction": "passage: "})
    _, first, took = run_backfill(dep, spec, table, shard_size=4, workers=2)
    c = counts(dep, first)
    assert c["status"] == "published" and c["outstanding"] == 0 and c["dead_letters"] == 0
    with db.connect(dep.ledger_url) as conn:
        rid = conn.execute(f"SELECT min(record_id) AS r FROM published.{dataset}").fetchone()["r"]
        near = _nearest(conn, dataset, rid)
        plan = "\n".join(r["QUERY PLAN"] for r in conn.execute(
            f"EXPLAIN SELECT record_id FROM published.{dataset} ORDER BY embedding <=> "
            f"(SELECT embedding FROM published.{dataset} WHERE record_id = %s) LIMIT 3", (rid,)))
        n = conn.execute(f"SELECT count(*) AS n FROM published.{dataset}").fetchone()["n"]
    assert n == c["stored"] == 8 - c["dead_letters"]
    assert near[0]["record_id"] == rid and {r["job_version"] for r in near} == {first}
    assert "embed_" in plan, plan          # the version's search table, with its index, behind the view

    # A second version (another instruction: a new job version) published, then rolled back from the
    # dashboard's API: the search moves back with the pointer.
    spec2 = write_spec(dep, dataset, drop, **base, prompt={"version": "e1", "template": "{text}"},
                       embedding={"dimensions": 576, "instruction": "query: "})
    _, second, _ = run_backfill(dep, spec2, table, shard_size=4, workers=2)
    assert second != first
    with db.connect(dep.ledger_url) as conn:
        assert {r["job_version"] for r in _nearest(conn, dataset, rid)} == {second}
    r = dep.http.post(f"/batch-inference/api/datasets/{dataset}/rollback",
                      json={"expected_current": second, "reason": "live embed test"},
                      headers={"Authorization": f"Bearer {dep.token}"})
    assert r.status_code == 200, r.text
    with db.connect(dep.ledger_url) as conn:
        back = _nearest(conn, dataset, rid)
    assert back == near
    print(f"embedding as deployed: 8 records, trigger to published {took:.1f} s; nearest to {rid}: "
          f"{[x['record_id'] for x in near]}")
