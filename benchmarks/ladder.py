"""The model ladder's bill and accuracy against its top rung alone, in one run.

Two engines of our own, of known quality, loaded by dotted path
(``benchmarks.ladder:KnownEngine``, allowed through
``BATCH_INFERENCE_ENGINE_MODULES``), label tickets whose right label and
difficulty the text carries (``[label=billing]``, ``[hard]``):

* ``cheap`` (rung 1): right on every easy ticket, sure of it (token
  log-probability -0.02); on a hard one unsure (-1.2 to -2.5) and right only
  one time in three;
* ``dear`` (rung 2): right on every ticket, sure of it.

The run: calibrate the ladder on a golden set of ``--golden`` tickets
(``batch-inference calibrate``'s code), then run ``--records`` tickets through
the calibrated cascade and, beside it, through the dear engine alone (a
one-model job of the same records), each with an in-process worker on the
real ledger. Bills are the rungs' prices times the answers each rung gave
(from bi.ladder_answers); accuracies are against the labels in the text and,
for the golden set, what calibrate measured. Goal (issue 38): the cascade's
bill at most half the top rung's, at 98% or more of its accuracy.

``--real N`` adds the two-rung ladder with SmolLM2-135M on llama.cpp at both
rungs (different params) over N tickets, end to end, figures as they are.

    python -m benchmarks.ladder [--records N] [--golden G] [--hard-share S] [--real N]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from batch_inference.engines.base import Engine, Outcome, Request

LABELS = ("billing", "bug", "account", "other")
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"category": {"type": "string", "enum": list(LABELS)}},
    "required": ["category"],
    "additionalProperties": False,
}
KNOWN_ENGINE = "benchmarks.ladder:KnownEngine"
PRICES = {"cheap": 0.0004, "dear": 0.004}     # dollars per record: the dear model at 10x the cheap one
_LABEL = re.compile(r"\[label=(\w+)\]")


def _unit(*parts: str) -> float:
    """A number in [0, 1) fixed by ``parts`` (the same record, the same draw, in every run)."""
    return int(hashlib.sha256("\x1f".join(parts).encode()).hexdigest()[:8], 16) / 2**32


class KnownEngine(Engine):
    """An engine of known quality (see the module docstring). Options: ``quality`` (cheap or dear),
    ``delay_s`` (seconds per record, default 0)."""

    name = "known"
    option_names = frozenset({"quality", "delay_s"})
    serves_models = frozenset({"known-cheap", "known-dear"})
    endpoint = "local"
    gives_logprobs = True

    def __init__(self, spec, options=None):
        super().__init__(spec, options)
        self.quality = str(self.option("quality", "dear"))
        self.delay_s = float(self.option("delay_s", 0.0))

    def load(self) -> None:
        pass

    def answer(self, req: Request) -> tuple[str, float]:
        """(label, log-probability of its tokens) for one ticket."""
        text = req.text or ""
        m = _LABEL.search(text)
        right = m.group(1) if m else "other"
        if self.quality == "dear" or "[hard]" not in text:
            return right, -0.02
        draw = _unit(req.record_id, str(self.spec.params.seed))
        unsure = -1.2 - 1.3 * _unit(req.record_id, "sure")
        if draw < 1 / 3:
            return right, unsure
        wrong = [x for x in LABELS if x != right]
        return wrong[int(draw * 3) % len(wrong)], unsure

    def generate(self, requests: Sequence[Request], stop: threading.Event) -> Iterator[Outcome]:
        for req in requests:
            if stop.is_set():
                return
            if self.delay_s:
                time.sleep(self.delay_s)
            label, lp = self.answer(req)
            head, tail = '{"category": "', '"}'
            tokens = ((head, -0.01), (label, lp), (tail, -0.01))
            yield Outcome(req.record_id, head + label + tail, tokens_out=3,
                          logprobs=tokens if self.want_logprobs else None)


def ticket_rows(n: int, hard_share: float, start: int = 0, prefix: str = "t") -> list[tuple[str, str, str]]:
    """(id, text, right label) of ``n`` tickets; about ``hard_share`` of them hard."""
    rows = []
    for i in range(start, start + n):
        rid = f"{prefix}{i:06d}"
        label = LABELS[int(_unit(rid, "label") * len(LABELS))]
        hard = _unit(rid, "hard") < hard_share
        rows.append((rid, f"Ticket {i}: a customer writes about their account. [label={label}]"
                          f"{' [hard]' if hard else ''}", label))
    return rows


def known_ladder(table: str, golden: str | None, *, delay_s: float = 0.0, target: float = 0.98,
                 thresholds: tuple[float | None, ...] = (None,), **over: Any) -> dict[str, Any]:
    """A ladder spec (as a dict) of the cheap and the dear known engines over ``table``."""
    def rung(quality: str, threshold: float | None) -> dict[str, Any]:
        return {"model": {"name": f"known-{quality}", "digest": hashlib.sha256(quality.encode()).hexdigest()},
                "engine": {"name": KNOWN_ENGINE, "options": {"quality": quality, "delay_s": delay_s}},
                "params": {"temperature": 0, "max_tokens": 16}, "threshold": threshold,
                "cost_per_row": PRICES[quality]}

    d: dict[str, Any] = {
        "dataset": "ladder_bench",
        "source": {"table": table, "id_column": "id", "text_column": "body"},
        "prompt": {"version": "v1", "system": "Label the ticket: billing, bug, account or other."},
        "output_schema": SCHEMA,
        "models": [rung("cheap", thresholds[0]), rung("dear", None)],
        "ladder": {"confidence": "logprobs", "target": target},
        "shard_size": 500, "lease_seconds": 60, "renew_seconds": 5,
    }
    if golden:
        d["evaluation"] = {"golden": {"table": golden, "id_column": "id", "text_column": "body",
                                      "expected_column": "expected"}}
    d.update(over)
    return d
