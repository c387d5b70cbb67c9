"""Drift: how far a version's category distribution moved from another's.

The measure is total variation (half the sum of absolute share differences),
the one the spec's ``validation.max_drift`` gates. The validator and the
dashboard both compute it here, from the same counts: a version's
validation report keeps its counts per category, so a validated version's
rows need not be read again.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import psycopg

from batch_inference.db import q

NO_CATEGORY = "(none)"    # the key for rows whose category is NULL


def category_key(category: str | None) -> str:
    return NO_CATEGORY if category is None else category


def category_counts(conn: psycopg.Connection, job_version: str,
                    validation: Any = None) -> tuple[dict[str, int], str]:
    """Rows per category of a version, and where they came from: its
    ``validation`` report when that holds them ("validation"), else counted
    from its results ("results")."""
    stored = validation.get("categories") if isinstance(validation, Mapping) else None
    if isinstance(stored, Mapping) and all(isinstance(v, int) for v in stored.values()):
        return {str(k): int(v) for k, v in stored.items()}, "validation"
    return ({category_key(r["category"]): int(r["n"])
             for r in conn.execute(q("category_counts"), {"job": job_version})}, "results")


def shares(counts: Mapping[str, int]) -> dict[str, float]:
    total = sum(counts.values())
    return {k: v / total for k, v in counts.items()} if total else {}


def compare(current: Mapping[str, int], baseline: Mapping[str, int]) -> dict[str, Any]:
    """``distance`` (None when either side has no rows) and, per category,
    its ``current`` and ``published`` shares and their ``shift``, rounded to
    six places."""
    p, b = shares(current), shares(baseline)
    per = {}
    for cat in sorted(set(p) | set(b)):
        cur, old = p.get(cat, 0.0), b.get(cat, 0.0)
        per[cat] = {"current": round(cur, 6), "published": round(old, 6), "shift": round(cur - old, 6)}
    distance = round(0.5 * sum(abs(p.get(c, 0.0) - b.get(c, 0.0)) for c in per), 6) if p and b else None
    return {"distance": distance, "per_category": per}


def over_gate(distance: float | None, gate: float) -> bool:
    """Whether a distance fails the ``validation.max_drift`` gate (no distance never does)."""
    return distance is not None and distance > gate
