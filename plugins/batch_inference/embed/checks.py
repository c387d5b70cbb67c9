"""What the validator checks of an embedding job version (``validate.validate`` calls these for ``task: embed``).

* ``scan``: every stored vector, streamed: present, exactly ``dimensions``
  float32 values, every value finite, and a unit norm (within
  ``validation.max_norm_error``) when ``normalize`` is set.
* ``drift``: against the published version, on records both embedded from
  the same content (a deterministic sample of ``DRIFT_SAMPLE``): the mean
  share of each record's ``DRIFT_K`` nearest neighbours (among the sample,
  by cosine) that changed, which works across models of different sizes
  and is gated by ``validation.max_drift``; the share whose first neighbour
  changed; and, for the same size, the cosine shift of the centroid.
* ``recall``: ``evaluation.pairs`` (a table of record-id pairs that must be
  near): the share of pairs whose right record is among the left one's
  ``k`` nearest neighbours in the whole version (exact search, streamed),
  gated by ``min_recall``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import psycopg
from psycopg import sql

from batch_inference.db import composed, q
from batch_inference.embed.vectors import DTYPE, from_storage, matrix
from batch_inference.spec import JobSpec

FETCH = 5_000        # rows per fetch of a streamed scan
EXAMPLES = 5
DRIFT_SAMPLE = 2_000
DRIFT_K = 10
MAX_PAIRS = 10_000


def scan(conn: psycopg.Connection, spec: JobSpec, job: str, failures: list[str]
         ) -> tuple[dict[str, Any], dict[tuple[str | None, str | None, str], int]]:
    """The vector section of the report, and the rows per (engine, endpoint class, transport)."""
    dims, tol = spec.embedding.dimensions, spec.validation.max_norm_error
    counts = {"checked": 0, "missing": 0, "wrong_dimension": 0, "not_finite": 0, "norm_off": 0}
    examples: list[dict[str, str]] = []
    made_by: dict[tuple[str | None, str | None, str], int] = {}
    stored_bytes = 0

    def bad(kind: str, record_id: str, reason: str) -> None:
        counts[kind] += 1
        if len(examples) < EXAMPLES:
            examples.append({"record_id": record_id, "reason": reason})

    with conn.transaction(), conn.cursor(name="bi_embed_scan") as cur:
        cur.itersize = FETCH
        cur.execute(q("embed_scan"), {"job": job})
        while rows := cur.fetchmany(FETCH):
            good_ids, good = [], []
            for r in rows:
                counts["checked"] += 1
                made = (r["engine"], r["endpoint"], r["transport"])
                made_by[made] = made_by.get(made, 0) + 1
                stored_bytes += r["bytes"] or 0
                data = r["embedding"]
                if data is None:
                    bad("missing", r["record_id"], "no vector stored")
                elif len(data) != 4 * dims:
                    bad("wrong_dimension", r["record_id"], f"{len(data) / 4:g} dimensions, not {dims}")
                else:
                    good_ids.append(r["record_id"])
                    good.append(data)
            if not good:
                continue
            m = matrix(good, dims)
            finite = np.isfinite(m).all(axis=1)
            for i in np.flatnonzero(~finite):
                bad("not_finite", good_ids[i], "a value is not finite")
            if spec.embedding.normalize:
                err = np.abs(np.linalg.norm(m.astype(np.float64), axis=1) - 1.0)
                for i in np.flatnonzero(finite & (err > tol)):
                    bad("norm_off", good_ids[i], f"norm is off 1 by {err[i]:.2g} (max {tol:g})")
    wrong = sum(v for k, v in counts.items() if k != "checked")
    if wrong:
        first = examples[0]
        failures.append(f"vectors: {wrong} of {counts['checked']} stored vectors fail the checks "
                        f"({first['record_id']}: {first['reason']})")
    section = {**counts, "invalid": wrong, "dimensions": dims, "normalize": spec.embedding.normalize, "examples": examples,
               "bytes_per_vector": round(stored_bytes / counts["checked"], 1) if counts["checked"] else None}
    return section, made_by


def _vectors(conn: psycopg.Connection, job: str, ids: list[str]) -> dict[str, np.ndarray]:
    return {r["record_id"]: from_storage(r["embedding"])
            for r in conn.execute(q("embed_vectors_of"), {"job": job, "ids": ids})}


def _unit(m: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(m, axis=1, keepdims=True)
    return m / np.where(norms > 0, norms, 1.0)


def neighbours(m: np.ndarray, k: int) -> np.ndarray:
    """Each row's ``k`` nearest other rows by cosine (indices, nearest first)."""
    u = _unit(m.astype(np.float32))
    sims = u @ u.T
    np.fill_diagonal(sims, -np.inf)
    k = min(k, len(m) - 1)
    top = np.argpartition(-sims, k - 1, axis=1)[:, :k]
    order = np.take_along_axis(sims, top, axis=1).argsort(axis=1)[:, ::-1]
    return np.take_along_axis(top, order, axis=1)


def drift(conn: psycopg.Connection, spec: JobSpec, job: str, against: str, failures: list[str],
          notes: list[str]) -> dict[str, Any]:
    """Neighbour drift against version ``against`` on the records both embedded (see the module docstring)."""
    threshold = spec.validation.max_drift
    out: dict[str, Any] = {"distance": None, "threshold": threshold, "against": against, "shared": 0,
                           "first_neighbour_changed": None, "centroid_shift": None, "k": DRIFT_K}
    ids = [r["record_id"] for r in conn.execute(q("embed_shared_sample"),
                                                {"job": job, "base": against, "n": DRIFT_SAMPLE})]
    out["shared"] = len(ids)
    if len(ids) < 3:
        notes.append(f"drift: skipped, {len(ids)} record(s) embedded by both this version and {against}")
        return out
    mine, theirs = _vectors(conn, job, ids), _vectors(conn, against, ids)
    a = np.stack([mine[i] for i in ids])
    b = np.stack([theirs[i] for i in ids])
    na, nb = neighbours(a, DRIFT_K), neighbours(b, DRIFT_K)
    k = na.shape[1]
    kept = np.array([len(set(x) & set(y)) for x, y in zip(na.tolist(), nb.tolist())]) / k
    out["distance"] = round(float(1.0 - kept.mean()), 4)
    out["first_neighbour_changed"] = round(float((na[:, 0] != nb[:, 0]).mean()), 4)
    if a.shape[1] == b.shape[1]:
        ca, cb = a.astype(np.float64).mean(axis=0), b.astype(np.float64).mean(axis=0)
        denom = np.linalg.norm(ca) * np.linalg.norm(cb)
        out["centroid_shift"] = round(float(1.0 - ca @ cb / denom), 6) if denom > 0 else None
    if out["distance"] > threshold:
        failures.append(f"drift: {out['distance']:.2f} of the {k} nearest neighbours changed against {against} "
                        f"(on {len(ids)} records both embedded), over the gate of {threshold:.2f}")
    return out


def recall(conn: psycopg.Connection, spec: JobSpec, job: str, failures: list[str],
           notes: list[str]) -> dict[str, Any] | None:
    """Recall@k of ``evaluation.pairs`` in version ``job`` (exact nearest neighbours over every vector)."""
    pairs_spec = spec.evaluation.pairs
    if pairs_spec is None:
        return None
    schema, _, table = pairs_spec.table.rpartition(".")
    stmt = composed("embed_pairs", table=sql.Identifier(schema, table),
                    left=sql.Identifier(pairs_spec.left_column), right=sql.Identifier(pairs_spec.right_column))
    pairs = [(r["left_id"], r["right_id"]) for r in conn.execute(stmt, {"n": MAX_PAIRS})]
    k = pairs_spec.k
    lefts = sorted({left for left, _ in pairs})
    have = _vectors(conn, job, sorted({x for p in pairs for x in p}))
    usable = [(left, right) for left, right in pairs if left in have and right in have]
    out: dict[str, Any] = {"pairs": len(pairs), "usable": len(usable), "k": k, "recall": None,
                           "min_recall": pairs_spec.min_recall}
    if len(usable) < len(pairs):
        notes.append(f"pairs: {len(pairs) - len(usable)} of {len(pairs)} pairs name a record this version did "
                     "not embed")
    if not usable:
        if pairs_spec.min_recall is not None:
            failures.append("pairs: no pair of evaluation.pairs names two records of this version")
        return out
    lefts = [left for left in lefts if left in have]
    queries = _unit(np.stack([have[left] for left in lefts]).astype(np.float32))
    top_s = np.full((len(lefts), k), -np.inf, dtype=np.float32)
    top_i = np.full((len(lefts), k), "", dtype=object)
    with conn.transaction(), conn.cursor(name="bi_embed_recall") as cur:
        cur.itersize = FETCH
        cur.execute(q("embed_scan"), {"job": job})
        while rows := cur.fetchmany(FETCH):
            rows = [r for r in rows if r["embedding"] is not None and len(r["embedding"]) == 4 * len(queries[0])]
            if not rows:
                continue
            ids = np.array([r["record_id"] for r in rows], dtype=object)
            sims = queries @ _unit(np.stack([from_storage(r["embedding"]) for r in rows]).astype(DTYPE)).T
            sims[ids[None, :] == np.array(lefts, dtype=object)[:, None]] = -np.inf   # not itself
            both_s = np.concatenate([top_s, sims], axis=1)
            both_i = np.concatenate([top_i, np.broadcast_to(ids, sims.shape)], axis=1)
            keep = np.argpartition(-both_s, k - 1, axis=1)[:, :k]
            top_s = np.take_along_axis(both_s, keep, axis=1)
            top_i = np.take_along_axis(both_i, keep, axis=1)
    near = {left: set(top_i[n].tolist()) for n, left in enumerate(lefts)}
    found = sum(1 for left, right in usable if right in near[left])
    out["recall"] = round(found / len(usable), 4)
    if pairs_spec.min_recall is not None and out["recall"] < pairs_spec.min_recall:
        failures.append(f"pairs: recall@{k} is {out['recall']:.2%} ({found} of {len(usable)} pairs), under the "
                        f"gate of {pairs_spec.min_recall:.2%}")
    return out
