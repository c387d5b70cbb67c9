"""The plan of bi.put_results_v3's insert (the real embedded PostgreSQL, auto_explain).

Whatever the statistics say, the snapshot rows of a call's results are read
in one scan of the primary key for all of the call's ids and hash-joined to
its arrays: no nested loop (one probe, or one scan, per result) and no scan
of the whole shard or job (sql/schema/ledger.sql).
"""

from __future__ import annotations

import pytest

from batch_inference.ledger import Ledger
from batch_inference.plan import submit
from tests.conftest import make_source, make_spec, tickets

OUT = '{"category": "billing", "summary": "charged twice"}'


@pytest.mark.parametrize("analyzed", [False, True], ids=["no statistics", "analyzed"])
def test_put_reads_the_snapshot_in_one_key_scan(conn, analyzed):
    make_source(conn, tickets(3000))
    job = submit(conn, make_spec(shard_size=1000)).job_version
    if analyzed:
        conn.execute("ANALYZE bi.snapshot_rows")
    plans: list[str] = []
    conn.add_notice_handler(lambda d: plans.append(d.message_primary or ""))
    conn.execute("LOAD 'auto_explain'")
    for setting, value in (("log_min_duration", "0"), ("log_nested_statements", "on"), ("log_level", "notice")):
        conn.execute(f"SET auto_explain.{setting} = {value}")
    lg = Ledger(conn, job, "w", engine="noop", endpoint="local")
    lease = lg.claim()
    ids = [r["record_id"] for r in lg.records(lease)]
    for i in range(0, len(ids), 250):                  # past the plan cache's first five calls
        chunk = ids[i:i + 250]
        assert lg.put_results(lease, chunk, [OUT] * len(chunk), ["billing"] * len(chunk)) == len(chunk)
    conn.execute("RESET auto_explain.log_min_duration")
    inserts = [p for p in plans if "Insert on results" in p]
    assert len(inserts) == 4, plans
    for plan in inserts:
        assert "Hash Join" in plan and "Nested Loop" not in plan and "Seq Scan" not in plan, plan
        assert "snapshot_rows" in plan and "_pkey" in plan and "record_id = ANY" in plan, plan
