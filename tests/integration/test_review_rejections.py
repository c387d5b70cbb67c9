"""A reviewer's rejection of a whole version, in the ledger (bi.review_rejections), on the real
embedded PostgreSQL: publish refuses a version whose rejection stands, even with its review gate
met and even forced, in the statement that switches the pointer; a rejection sent while a publish
is in flight waits for it and says the version is published; `batch-inference review --reject` /
`--withdraw-rejection` and `published` show who, why and when."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from batch_inference import db, evaluation
from batch_inference.cli import main as cli_main
from batch_inference.exceptions import PublishRefused, ReviewRefused
from batch_inference.publish import publish, published
from tests.integration.test_publish import DATASET, pointer, version, waits_on_a_lock

GATE = {"review": {"min_reviewed": 1, "min_right": 1.0}}


def meet_the_gate(conn, job: str) -> None:
    row = evaluation.review_rows(conn, job)[0]
    evaluation.record_review(conn, job, row["record_id"], "right", reviewer="cli:ana")
    assert evaluation.review_state(conn, job)["passed"]


def test_a_standing_rejection_refuses_publish_with_the_gate_met_and_forced_until_withdrawn(conn, db_url, capsys):
    job = version(conn, db_url, 20, evaluation=GATE)
    meet_the_gate(conn, job)

    assert cli_main(["review", job, "--reject", "--reason", "  ", "--db", db_url]) == 2
    assert "--reject needs --reason WHY" in capsys.readouterr().err
    assert cli_main(["review", job, "--reject", "--reason", "categories are all billing", "--reviewer", "cli:rita",
                     "--db", db_url]) == 0
    out = capsys.readouterr().out
    assert f"{job}: rejected by cli:rita; publish refuses it until the rejection is withdrawn" in out
    assert "categories are all billing" in out

    state = evaluation.review_state(conn, job)
    assert state["reviewed"] == 1 and state["right"] == 1                     # the counts are met ...
    assert not state["passed"] and state["problem"] == "review: " + state["rejection"]   # ... the gate is not
    for force in (False, True):
        with pytest.raises(PublishRefused, match=f"^job version {job} was rejected by cli:rita at .* UTC: categories "
                                                 "are all billing; refused, even forced"):
            publish(conn, job, force=force, reason="ship it" if force else None)
    assert pointer(conn) is None

    assert cli_main(["review", job, "--withdraw-rejection", "--reason", "relabelled", "--reviewer", "cli:ana",
                     "--db", db_url]) == 0
    assert "1 standing rejection(s) withdrawn by cli:ana" in capsys.readouterr().out
    assert publish(conn, job)["changed"] and pointer(conn) == job
    (rej,) = published(conn, DATASET)["rejections"]
    assert (rej["job_version"], rej["reviewer"], rej["reason"], rej["standing"], rej["withdrawn_by"],
            rej["withdraw_reason"]) == (job, "cli:rita", "categories are all billing", False, "cli:ana", "relabelled")
    assert cli_main(["published", DATASET, "--db", db_url]) == 0
    assert "rejected  " + job + "  by cli:rita: categories are all billing (withdrawn by cli:ana: relabelled)" \
        in capsys.readouterr().out


def test_a_rejection_sent_while_a_publish_is_in_flight_waits_for_it_and_says_published(conn, db_url):
    job = version(conn, db_url, 10, evaluation=GATE)
    meet_the_gate(conn, job)
    result: dict[str, Any] = {}

    def reviewer() -> None:
        with db.connect(db_url, application_name="late-reject") as c:
            result["row"] = evaluation.record_rejection(c, job, reviewer="cli:rita", reason="too late")

    with db.connect(db_url) as publisher, publisher.transaction():
        publish(publisher, job, actor="nightly")                    # holds the version's row, not yet committed
        t = threading.Thread(target=reviewer)
        t.start()
        if not waits_on_a_lock(conn, "late-reject", t.is_alive):
            pytest.fail("the rejection did not wait for the publish in flight")
    t.join(timeout=30)
    assert result["row"]["status"] == "published" and pointer(conn) == job


def test_a_rejection_needs_a_reviewer_a_reason_and_a_version(conn, db_url):
    job = version(conn, db_url, 10)
    with pytest.raises(ReviewRefused, match="^the reason must not be empty$"):
        evaluation.record_rejection(conn, job, reviewer="cli:rita", reason=" ")
    with pytest.raises(ReviewRefused, match="^no job version jv_0000000000000000$"):
        evaluation.record_rejection(conn, "jv_0000000000000000", reviewer="cli:rita", reason="no")
    assert conn.execute("SELECT count(*) AS n FROM bi.review_rejections").fetchone()["n"] == 0
