"""`batch-inference redrive JOB_VERSION --dead-letters`, on the real embedded PostgreSQL: chosen dead
letters go back to pending under the same job version with a fresh attempt budget, recorded with
who, when and why; the workers then finish them; records refused before any worker stay dead; a
published version, nothing matching or a leased shard is refused in one line with nothing changed;
the dashboard's dead-letter panel lists the re-drives. Nothing re-drives by itself (I4)."""

from __future__ import annotations

import getpass

import pytest

from batch_inference import db
from batch_inference.cli import main as cli_main
from batch_inference.exceptions import RedriveRefused
from batch_inference.ledger import Ledger
from batch_inference.plan import redrive_dead_letters, redrives, submit
from batch_inference.publish import publish
from batch_inference.status import dead_letters, job_counts
from batch_inference.validate import validate
from tests.conftest import make_source, make_spec, tickets
from tests.integration.test_validate import finish

POISON = ["t00003", "t00007", "t00011"]


def dead_job(conn, db_url: str) -> str:
    """20 tickets, one too long for the input cap (dead at planning), three dead after their one attempt."""
    rows = tickets(20)
    rows[5] = (rows[5][0], "x" * 500, rows[5][2])
    make_source(conn, rows)
    job = submit(conn, make_spec(max_attempts=1, max_input_chars=400, shard_size=5,
                                 validation={"max_dead_letter_rate": 0.5})).job_version
    finish(db_url, job, fail=POISON)
    assert job_counts(conn, job)["dead_letters"] == 4
    return job


def dead_counts(conn, job: str) -> dict[tuple[str, str], int]:
    return {(r["reason"], r["stage"]): r["n"] for r in conn.execute(
        "SELECT reason, stage, n FROM bi.dead_letter_counts WHERE job_version = %s AND n <> 0", (job,))}


def test_redrive_puts_chosen_dead_letters_back_and_the_workers_finish_them(conn, db_url, capsys):
    job = dead_job(conn, db_url)
    assert validate(conn, job).passed
    before = {r["record_id"]: r for r in dead_letters(conn, job)}
    worker_reason = before["t00003"]["reason"]

    assert cli_main(["--db", db_url, "redrive", job, "--dead-letters", "--stage", "worker", "--reason-like",
                     worker_reason.upper()[:10], "--reason", "endpoint restarted with more memory"]) == 0
    out = capsys.readouterr().out
    assert f"{job}: 3 dead letter(s) back to pending in 3 shard(s), attempts reset" in out

    counts = job_counts(conn, job)
    assert counts["dead_letters"] == 1 and counts["outstanding"] == 3 and counts["shards"]["pending"] == 3
    assert counts["status"] == "running"                                 # validate again after the workers
    assert set(r["record_id"] for r in dead_letters(conn, job)) == {"t00005"}   # refused at planning: stays
    assert dead_counts(conn, job) == {(before["t00005"]["reason"], "plan"): 1}
    assert conn.execute("SELECT count(*) AS n FROM bi.attempts WHERE job_version = %s AND record_id = ANY (%s)",
                        (job, POISON)).fetchone()["n"] == 0               # a fresh budget of max_attempts
    (rd,) = redrives(conn, job)
    assert (rd["actor"], rd["reason"], rd["stage"], rd["reason_like"], rd["records"], rd["shards"], rd["left_out"]) \
        == (f"cli:{getpass.getuser()}", "endpoint restarted with more memory", "worker", worker_reason.upper()[:10],
            3, 3, 0)

    # Nothing re-drives by itself: the same version's workers now store them, once.
    finish(db_url, job)
    counts = job_counts(conn, job)
    assert (counts["stored"], counts["dead_letters"], counts["outstanding"]) == (19, 1, 0)
    assert conn.execute("SELECT count(*) AS n FROM bi.results WHERE job_version = %s AND record_id = ANY (%s)",
                        (job, POISON)).fetchone()["n"] == 3
    assert validate(conn, job).passed

    from batch_inference.ui import data

    shown = data.dead_letters(conn, job)
    assert shown["total"] == 1 and [r["records"] for r in shown["redrives"]] == [3]

    # Only the planning reject is left: nothing a worker could do, refused with nothing written.
    with pytest.raises(RedriveRefused, match=f"^job version {job}: no dead letter to re-drive matches \\(1 matching "
                                             "were refused before any worker: their input is refused\\)$"):
        redrive_dead_letters(conn, job, actor="ana", reason="again")
    publish(conn, job)
    assert cli_main(["--db", db_url, "redrive", job, "--dead-letters", "--reason", "late"]) == 2
    err = capsys.readouterr().err
    assert err == (f"batch-inference redrive: error: job version {job} is published: its dead letters are not "
                   "re-driven (submit a new version)\n")
    assert len(redrives(conn, job)) == 1


def test_a_redrive_is_refused_in_one_line_with_nothing_changed(conn, db_url, capsys):
    job = dead_job(conn, db_url)
    with pytest.raises(RedriveRefused, match=f"^job version {job}: no dead letter to re-drive matches$"):
        redrive_dead_letters(conn, job, actor="ana", reason="oom fixed", reason_like="no such reason")
    with pytest.raises(RedriveRefused, match="^a re-drive needs who and why"):
        redrive_dead_letters(conn, job, actor="ana", reason="  ")
    with pytest.raises(SystemExit, match="2"):                                   # --dead-letters is required
        cli_main(["--db", db_url, "redrive", job, "--reason", "x"])
    assert "--dead-letters" in capsys.readouterr().err
    # A matching shard held by a worker now: refused until its workers have stopped.
    shard = conn.execute("SELECT sr.shard_no FROM bi.snapshot_rows sr WHERE sr.job_version = %s "
                         "AND sr.record_id = 't00003'", (job,)).fetchone()["shard_no"]
    conn.execute("UPDATE bi.shards SET state = 'pending' WHERE job_version = %s AND shard_no = %s", (job, shard))
    lease = Ledger(conn, job, "busy-worker").claim()
    assert lease.shard_no == shard
    with pytest.raises(RedriveRefused, match=f"^job version {job}: shard {shard} is leased; re-drive once its "
                                             "workers have stopped$"):
        redrive_dead_letters(conn, job, actor="ana", reason="oom fixed")
    assert job_counts(conn, job)["dead_letters"] == 4 and redrives(conn, job) == []
