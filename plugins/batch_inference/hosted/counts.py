"""The cutoff's hosted term: work a provider has done that the ledger has not stored yet.

A hosted batch's results arrive when the batch ends, so while it runs the
ledger counts its records outstanding although the provider may have
succeeded most of them. The transport's poll mirrors each provider batch's
request counts into ``bi.hosted_batches``; ``bi.hosted_counts_v1`` sums them
over the batches still in flight (its cost follows those batches, not the
job's shards), and the cutoff subtracts the succeeded ones from outstanding,
as the seed does (outstanding = processing + errored). Only the cutoff reads
the adjusted figure: the fallback pool and ``status`` keep the ledger's own.
"""

from __future__ import annotations

from typing import Any

import psycopg

from batch_inference.db import q


def with_hosted(counts: Any, row: dict[str, Any] | None) -> Any:
    """``counts`` (a JobCounts) with ``hosted_in_flight`` and ``hosted_succeeded`` added and
    the provider-succeeded requests taken off ``outstanding`` (never below zero)."""
    out = dict(counts)
    requests = int(row["requests"]) if row else 0
    succeeded = min(int(row["succeeded"]) if row else 0, int(out["outstanding"]))
    out["hosted_in_flight"] = requests
    out["hosted_succeeded"] = succeeded
    out["outstanding"] = int(out["outstanding"]) - succeeded
    return out


def hosted_row(conn: psycopg.Connection, job_version: str) -> dict[str, Any] | None:
    return conn.execute(q("hosted_counts"), {"job": job_version}).fetchone()
