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


# The model a noop-engine spec pins: the noop engine loads no weights.
NOOP_MODEL: dict[str, str] = {"name": "noop", "digest": "0" * 64}


def write_noop_spec(directory: Path, **over: Any) -> Path:
    """The demo spec on the noop engine, ``over`` merged in (a dict one level deep), written to
    ``directory/<dataset>.yaml``: a worker refuses ``engine: noop`` over a spec that pins a real model,
    so a run without a model (``demo --engine noop``, the DAG tests) needs a spec of its own."""
    import yaml

    spec = yaml.safe_load(DEMO_SPEC.read_text())
    over = {"engine": {"name": "noop"}, "model": dict(NOOP_MODEL), **over}
    for key, value in over.items():
        spec[key] = {**spec[key], **value} if isinstance(value, dict) and isinstance(spec.get(key), dict) else value
    path = Path(directory) / f"{spec['dataset']}.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path

