"""A vector as the ledger stores it: float32, little-endian, ``4 * dimensions`` bytes in ``bi.results.embedding``.

``to_storage`` (``outputs.to_storage``, the worker's check) checks one engine
vector (exact dimension, every value finite, a unit norm when the spec
normalizes) and returns its bytes and the small JSON output the result row
keeps beside it; a vector that fails is the record's failed attempt, with the
reason. ``from_storage`` reads the
bytes back (no copy: a read-only view of them).
"""

from __future__ import annotations

import math

import numpy as np

# The check itself sits below the worker (it runs there), in the core's output checks.
from batch_inference.outputs import DTYPE, MIN_NORM, to_storage

__all__ = ["DTYPE", "MIN_NORM", "from_storage", "matrix", "norm_error", "to_storage"]

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
