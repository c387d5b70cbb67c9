"""Sample data shipped with the package: the demo's support tickets and its job spec.

* ``tickets.jsonl``: 320 support tickets (``make_tickets.py`` writes them,
  deterministically), including hostile ones: prompt injection, SQL-looking
  text, odd Unicode, a blank ticket and a pasted log over the input cap.
* ``tickets_expected.jsonl``: each ticket's true category and priority
  (``make_tickets.py --expected``), the demo's golden set;
* ``tickets_spec.yaml``: the job spec the example DAGs and the demo run:
  SmolLM2 on llama.cpp, a short schema-bounded output, and the gates.
* ``tickets_hosted_spec.yaml``: the same job on a hosted batch API
  (``openai-batch``), with the synchronous API as the fallback
  (``batch_inference_hosted``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

DATA_DIR = Path(__file__).resolve().parent
TICKETS = DATA_DIR / "tickets.jsonl"
DEMO_SPEC = DATA_DIR / "tickets_spec.yaml"
HOSTED_SPEC = DATA_DIR / "tickets_hosted_spec.yaml"   # the same job on OpenAI's Batch API (openai-batch)
DEMO_DATASET = "ticket_triage"
DEMO_SOURCE_TABLE = "public.support_tickets"
TICKETS_EXPECTED = DATA_DIR / "tickets_expected.jsonl"
DEMO_LABELS_TABLE = "public.support_ticket_labels"   # the demo spec's golden set (evaluation.golden)
# A small output schema (a category and a one-line summary) for the jobs that need no model:
# the chaos harness, the test suite and the benchmarks.
TRIAGE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "category": {"type": "string", "enum": ["billing", "bug", "account", "other"]},
        "summary": {"type": "string", "maxLength": 200},
    },
    "required": ["category", "summary"],
    "additionalProperties": False,
}


def path(name: str) -> Path:
    return DATA_DIR / name


def read_tickets(limit: int | None = None) -> Iterator[dict[str, Any]]:
    """The sample tickets in file order (hostile ones are spread evenly, so any prefix has some)."""
    with TICKETS.open(encoding="utf-8") as f:
        for i, line in enumerate(f):
            if limit is not None and i >= limit:
                return
            yield json.loads(line)


def expected_labels() -> dict[str, dict[str, str]]:
    """Each labelled sample ticket's id -> its true {category, priority}."""
    with TICKETS_EXPECTED.open(encoding="utf-8") as f:
        return {row["id"]: row["expected"] for row in map(json.loads, f)}
