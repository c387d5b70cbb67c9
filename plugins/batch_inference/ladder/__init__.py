"""The model ladder: the cheapest model that is good enough, per record.

A spec may name ``models:``, rungs cheapest first, each a pinned model with
its engine, params, price per record and threshold. Every record goes to
rung 1; its answer is kept when it is valid and confident enough, else the
record goes on to the next rung (docs/ladder.md). The interface:

* ``rungs``: the rungs of a spec, each rung's one-model spec, the confidence
  rules (token log-probabilities, or agreement of k samples) and the rule
  that keeps or escalates an answer;
* ``engine.LadderEngine``: the ladder as one engine behind the worker (the
  spec's engine is ``ladder``); every rung's answers go to bi.ladder_answers
  under the lease (``audit``), the final one to bi.results;
* ``calibrate``: runs the golden set up every rung and picks the thresholds
  that keep the cascade's golden accuracy within ``ladder.target`` of the top
  rung's at the least bill; ``report``: each rung's share of records, accuracy
  and cost for a job version.

Nothing here imports Airflow; ``engine`` is imported
only where it runs.
"""

from __future__ import annotations

from typing import Any

from batch_inference.ladder.audit import WRITE_EVERY
from batch_inference.ladder.calibrate import calibrate, check, with_thresholds
from batch_inference.ladder.rungs import Answer, agree, check_engines, keeps, rung_spec, rungs_of, samples

__all__ = ["WRITE_EVERY", "Answer", "agree", "calibrate", "check", "check_engines", "keeps", "rung_report",
           "rung_spec", "rungs_of", "samples", "with_thresholds"]


def rung_report(conn: Any, job_version: str) -> dict[str, Any] | None:
    """Each rung's share of records, accuracy and cost for a job version; None for a one-model job
    (``report.report``)."""
    from batch_inference.ladder.report import report

    return report(conn, job_version)
