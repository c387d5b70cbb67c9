"""The ladder's answers in the ledger (bi.ladder_answers, sql/schema/ladder.sql).

A worker writes every rung's answer of a record of its shard under the lease
(``put``), and reads back what earlier holders wrote (``stored``) to resume
a record at the rung where it stopped. Both go through the worker's ledger
connection and are fenced by the lease's epoch like every other write:
a stale epoch raises ``StaleLease`` and writes nothing. A lost connection
is the ledger's ``call`` to handle: the worker's reconnects and retries (both
calls are safe to repeat), as it does for its own writes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import psycopg

from batch_inference.db import first_line, q
from batch_inference.exceptions import DatabaseUnavailable
from batch_inference.ladder.rungs import Answer
from batch_inference.ledger import Lease, Ledger, StaleLease

# Answers written to bi.ladder_answers (and handed on) at least this often (``engine.LadderEngine``).
WRITE_EVERY = 64
WRITE_SECONDS = 2.0


@dataclass(frozen=True)
class Stored:
    """A rung's answer as the ledger holds it."""

    rung: int
    output: str | None
    valid: bool
    confidence: float | None
    escalated: bool


def _run(ledger: Ledger, name: str, params: dict) -> list[dict]:
    try:
        return ledger.call(lambda: ledger.conn.execute(q(name), params).fetchall())
    except psycopg.OperationalError as exc:
        # Out of retries (or a ledger with none): the worker exits ExitCode.DB; the lease lapses and
        # another holder resumes from what is stored.
        raise DatabaseUnavailable(f"database connection lost writing the ladder's answers: {first_line(exc)}") from None


def put(ledger: Ledger, lease: Lease, rows: Sequence[tuple[int, Answer, bool]]) -> int:
    """Put-if-absent (rung, answer, escalated) rows; returns how many were new."""
    if not rows:
        return 0
    r = _run(ledger, "ladder_put_answers", {
        "job": lease.job_version, "shard": lease.shard_no, "epoch": lease.epoch, "owner": ledger.owner,
        "ids": [a.record_id for _, a, _ in rows], "rungs": [n for n, _, _ in rows],
        "outputs": [a.text for _, a, _ in rows], "valid": [a.valid for _, a, _ in rows],
        "confidence": [a.confidence for _, a, _ in rows], "escalated": [e for _, _, e in rows],
        "errors": [a.error for _, a, _ in rows]})[0]
    if r["stale"]:
        raise StaleLease(f"ladder answers refused: shard {lease.shard_no} epoch {lease.epoch} is stale")
    return int(r["n"])


def stored(ledger: Ledger, lease: Lease, ids: Sequence[str]) -> dict[str, dict[int, Stored]]:
    """Record id -> rung -> the answer stored for it (only records that have any)."""
    out: dict[str, dict[int, Stored]] = {}
    if not ids:
        return out
    for r in _run(ledger, "ladder_answers", {"job": lease.job_version, "shard": lease.shard_no,
                                             "epoch": lease.epoch, "ids": list(ids)}):
        out.setdefault(r["record_id"], {})[r["rung"]] = Stored(r["rung"], r["output"], r["valid"],
                                                               r["confidence"], r["escalated"])
    return out
