"""The plans of the put and the claim's shard read (the real embedded PostgreSQL, auto_explain).

Whatever the statistics say, the snapshot rows of a call's results are read
in one scan of the primary key for all of the call's ids and hash-joined to
its arrays: no nested loop (one probe, or one scan, per result) and no scan
of the whole shard or job. The shard read of a shard with nothing stored or
dead in a job with no attempts row is the shard index's range alone; otherwise
it probes bi.attempts per record only once the job has an attempts row
(sql/schema/ledger.sql).
"""

from __future__ import annotations

import pytest

from batch_inference.ledger import Failure, Ledger
from batch_inference.plan import submit
from tests.conftest import make_source, make_spec, tickets

OUT = '{"category": "billing", "summary": "charged twice"}'


def _explained(conn, analyze: bool = False) -> list[str]:
    """The plans of every statement from now on (auto_explain, as notices)."""
    plans: list[str] = []
    conn.add_notice_handler(lambda d: plans.append(d.message_primary or ""))
    conn.execute("LOAD 'auto_explain'")
    for setting, value in (("log_min_duration", "0"), ("log_nested_statements", "on"), ("log_level", "notice"),
                           ("log_analyze", "on" if analyze else "off")):
        conn.execute(f"SET auto_explain.{setting} = {value}")
    return plans


@pytest.mark.parametrize("analyzed", [False, True], ids=["no statistics", "analyzed"])
def test_put_reads_the_snapshot_in_one_key_scan(conn, analyzed):
    make_source(conn, tickets(3000))
    job = submit(conn, make_spec(shard_size=1000)).job_version
    if analyzed:
        conn.execute("ANALYZE bi.snapshot_rows")
    plans = _explained(conn)
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


def test_shard_read_probes_attempts_once_the_job_has_any(conn):
    make_source(conn, tickets(300))
    job = submit(conn, make_spec(shard_size=100)).job_version
    lg = Ledger(conn, job, "w", engine="noop", endpoint="local")
    lease = lg.claim()
    plans = _explained(conn, analyze=True)

    def reads() -> list[str]:
        return [p for p in plans if "FROM bi.snapshot_rows sr" in p and "FROM bi.attempts x" in p]

    def fresh_reads() -> list[str]:
        return [p for p in plans if "FROM bi.snapshot_rows sr" in p and "FROM bi.attempts x" not in p
                and "bi.results r" not in p and "bi.dead_letters d" not in p]

    for _ in range(7):                                 # past the plan cache's first five calls
        rows = lg.records(lease)
    assert len(rows) == 100 and not any(r["attempts"] or r["crashes"] for r in rows)
    # Nothing stored, dead or tried: the range of the shard's index alone, no anti-join, no probe.
    assert len(fresh_reads()) == 7 and not reads()
    for plan in fresh_reads():
        assert "_shard on snapshot_rows_" in plan and "Seq Scan" not in plan and "Sort" not in plan, plan
        assert "attempts_" not in plan and "results_" not in plan, plan
    plans.clear()
    first = rows[0]["record_id"]
    assert lg.put_results(lease, [first], [OUT], ["billing"]) == 1   # one stored: the general read
    for _ in range(7):
        rows = lg.records(lease)
    assert len(rows) == 99 and first not in {r["record_id"] for r in rows} and not any(r["attempts"] for r in rows)
    assert len(reads()) == 7 and not fresh_reads()
    for plan in reads():   # custom plans leave the scan out, the generic one never runs it
        assert all("never executed" in line for line in plan.splitlines() if "on attempts_" in line), plan
    plans.clear()
    conn.execute("SET plan_cache_mode = force_generic_plan")   # the gate holds in the generic plan too
    assert len(lg.records(lease)) == 99
    [generic] = reads()
    scans = [line for line in generic.splitlines() if "on attempts_" in line]
    assert scans and all("never executed" in line for line in scans), generic
    conn.execute("RESET plan_cache_mode")
    plans.clear()
    failed = rows[5]["record_id"]
    lg.fail(lease, [Failure(failed, "boom", None, 1)])
    rows = lg.records(lease)
    assert {r["record_id"]: r["attempts"] for r in rows if r["attempts"]} == {failed: 1}
    [plan] = reads()
    scans = [line for line in plan.splitlines() if "on attempts_" in line]
    assert scans and not any("never executed" in line for line in scans), plan
