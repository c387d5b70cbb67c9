"""The cost and cutoff commands reading a real job version on the embedded PostgreSQL."""

from __future__ import annotations

import json

from batch_inference import db
from batch_inference.ledger import Ledger
from batch_inference.plan import submit
from tests.conftest import make_source, make_spec, tickets
from tests.unit.test_cost import _run as run_cost
from tests.unit.test_cutoff import _run as run_cutoff


def _store_batch_results(db_url: str, job: str, n: int) -> None:
    """Settle ``n`` rows of the job through the batch transport, as a worker would."""
    with db.connect(db_url) as c:
        lg = Ledger(c, job, "batch-worker")
        lease = lg.claim()
        ids = [r["record_id"] for r in lg.records(lease)][:n]
        lg.put_results(lease, ids, [{"category": "billing", "summary": "charged twice"}] * len(ids),
                       ["billing"] * len(ids))


def test_cli_cost_of_a_job_version(db_url, conn, capsys):
    # A real job on the embedded PostgreSQL: 20 records, 10 stored by the
    # batch path, priced at the spec's own rates.
    make_source(conn, tickets(20))
    job = submit(conn, make_spec(cost={"batch_per_row": 0.5, "fallback_per_row": 1.0})).job_version
    _store_batch_results(db_url, job, 10)

    rc, out = run_cost(["cost", job, "--json", "--db", db_url], capsys)
    assert rc == 0, out.err
    doc = json.loads(out.out)
    assert (doc["records"], doc["stored"], doc["outstanding"]) == (20, 10, 10)
    assert doc["so_far"]["batch_rows"] == 10 and doc["so_far"]["total"] == 5.0
    fired = doc["if_fallback_now"]
    assert (fired["batch_cost"], fired["fallback_cost"], fired["total"]) == (5.0, 10.0, 15.0)
    assert fired["clean_batch_floor"] == 10.0 and fired["all_synchronous_ceiling"] == 20.0


def test_cli_cutoff_reads_a_job_version(db_url, conn, capsys):
    # A real job on the embedded PostgreSQL: 25 records, 10 stored by the
    # batch path. Rate and overhead come from the spec's fallback block.
    make_source(conn, tickets(25))
    job = submit(conn, make_spec(fallback={"rate": 0.5, "overhead_s": 600})).job_version
    _store_batch_results(db_url, job, 10)

    rc, out = run_cutoff(["cutoff", job, "--deadline", "06:00", "--now", "05:00", "--json", "--db", db_url], capsys)
    assert rc == 0, out.err
    doc = json.loads(out.out)
    # 15 outstanding at 0.5/s is 30 s, plus 600 s: 06:00 - 10.5 min = 05:49:30, floored to 05:49.
    assert doc["job_version"] == job and doc["done"] == 10 and doc["outstanding"] == 15
    assert (doc["rate"], doc["overhead_s"]) == (0.5, 600.0)
    assert doc["latest_safe_start_clock"] == "05:49:00"
    # a flag still overrides the spec
    rc, out = run_cutoff(["cutoff", job, "--deadline", "06:00", "--now", "05:00", "--rate", "85",
                    "--overhead", "1800", "--json", "--db", db_url], capsys)
    assert json.loads(out.out)["latest_safe_start_clock"] == "05:29:00"
