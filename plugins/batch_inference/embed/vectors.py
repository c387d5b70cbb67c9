"""A vector as the ledger stores it: float32, little-endian, ``4 * dimensions`` bytes in ``bi.results.embedding``.

``to_storage`` checks one engine vector (exact dimension, every value
finite, a unit norm when the spec normalizes) and returns its bytes and the
small JSON output the result row keeps beside it; a vector that fails is
the record's failed attempt, with the reason. ``from_storage`` reads the
bytes back (no copy: a read-only view of them).
"""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np

from batch_inference.spec import JobSpec

DTYPE = np.dtype("<f4")
# A vector whose norm is below this cannot be normalized: it points nowhere.
MIN_NORM = 1e-12


def to_storage(spec: JobSpec, vector: Any) -> tuple[bytes | None, str | None, str | None]:
    """``(bytes, output JSON text, None)`` for a vector fit to store under ``spec``, else ``(None, None, error)``."""
    dims = spec.embedding.dimensions
    try:
        v = np.asarray(vector, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        return None, None, f"embedding is not a list of numbers: {type(exc).__name__}"
    if v.ndim != 1:
        return None, None, f"embedding has shape {tuple(v.shape)}, not one vector"
    if v.shape[0] != dims:
        return None, None, f"embedding has {v.shape[0]} dimensions; the spec's embedding.dimensions is {dims}"
    if not np.isfinite(v).all():
        return None, None, f"embedding holds {int((~np.isfinite(v)).sum())} value(s) that are not finite"
    norm = float(np.linalg.norm(v))
    if spec.embedding.normalize:
        if norm < MIN_NORM:
            return None, None, "embedding is the zero vector: it cannot be normalized"
        v = v / norm
    stored = v.astype(DTYPE)
    if not np.isfinite(stored).all():     # a float64 value past float32's range
        return None, None, "embedding holds a value outside float32's range"
    return stored.tobytes(), json.dumps({"dimensions": dims, "norm": round(norm, 6)}), None


def from_storage(data: bytes | memoryview) -> np.ndarray:
    """The float32 vector of stored bytes (read-only)."""
    return np.frombuffer(data, dtype=DTYPE)


def matrix(rows: list[bytes | memoryview], dims: int) -> np.ndarray:
    """Stored vectors as one (n, dims) float32 matrix; a row of another size raises ValueError."""
    out = np.empty((len(rows), dims), dtype=DTYPE)
    for i, data in enumerate(rows):
        v = from_storage(data)
        if v.shape[0] != dims:
            raise ValueError(f"row {i}: {v.shape[0]} dimensions, not {dims}")
        out[i] = v
    return out


def norm_error(v: np.ndarray) -> float:
    return abs(math.sqrt(float(np.dot(v.astype(np.float64), v.astype(np.float64)))) - 1.0)
