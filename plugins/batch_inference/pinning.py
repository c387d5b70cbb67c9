"""Model pinning: the weights an engine loads must be the weights the spec names.

``spec.model.digest`` is part of the spec hash, so it decides the job version;
verifying it before ``engine.load()`` is what makes "same job version, same
model" true on every worker, whatever happens to the files on disk.

The digest of a set of files (``sha256_files``):

* one file: its sha256, as ``sha256sum FILE`` prints it;
* several files: the sha256 of the lines ``<sha256 of file>  <file name>\\n``
  for each file, sorted by file name in code-point order. That is exactly
  what ``LC_ALL=C sha256sum *.safetensors | sha256sum`` computes in the
  weights directory, so an operator can pin a model with standard tools.
  Only base names enter the digest, so the directory may be mounted anywhere.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from batch_inference.engines.base import Engine
    from batch_inference.spec import JobSpec

CHUNK = 1 << 20  # 1 MiB: large enough for full disk speed, small enough to stream multi-GB shards

# (path, size, mtime_ns) -> hex digest: a worker that loads the same weights
# for many shards hashes them once per process, and a changed file (new size
# or mtime) is hashed again.
_cache: dict[tuple[str, int, int], str] = {}


class DigestMismatch(ValueError):
    """The weights on disk are not the weights the spec pins.

    Catching this one class covers every way the pin can fail, so a worker
    refuses to start for all of them with the same exit code.
    """


class WeightsMissing(DigestMismatch):
    """The pinned weights are not there at all (missing, unreadable, none found)."""


def sha256_file(path: str | os.PathLike[str]) -> str:
    p = Path(path)
    try:
        st = p.stat()
        key = (str(p.resolve()), st.st_size, st.st_mtime_ns)
        if key in _cache:
            return _cache[key]
        h = hashlib.sha256()
        with p.open("rb") as f:
            while chunk := f.read(CHUNK):
                h.update(chunk)
    except FileNotFoundError:
        raise WeightsMissing(f"model weights file not found: {p}") from None
    except OSError as exc:
        raise WeightsMissing(f"cannot read model weights file {p}: {exc.strerror}") from None
    _cache[key] = h.hexdigest()
    return _cache[key]


def sha256_files(paths: Iterable[str | os.PathLike[str]]) -> str:
    """The digest of one or several weights files (see the module docstring)."""
    files = sorted((Path(p) for p in paths), key=lambda p: (p.name, str(p)))
    if not files:
        raise WeightsMissing("no weights files to hash")
    if len(files) == 1:
        return sha256_file(files[0])
    manifest = "".join(f"{sha256_file(p)}  {p.name}\n" for p in files)
    return hashlib.sha256(manifest.encode()).hexdigest()


def verify_weights(engine: "Engine", spec: "JobSpec") -> str | None:
    """Check the engine's weights against ``spec.model.digest``.

    Returns the digest checked, or None for a remote engine (no files: the
    endpoint's operator pins its model). Raises DigestMismatch naming the
    expected and actual digests and the file(s).
    """
    files = engine.weights_files()
    if not files:
        return None
    actual = sha256_files(files)
    expected = spec.model.digest.removeprefix("sha256:")
    if actual != expected:
        names = sorted(Path(f).name for f in files)
        shown = ", ".join(names if len(names) <= 4 else [*names[:3], "..."])
        where = str(files[0]) if len(files) == 1 else f"{len(files)} files in {Path(files[0]).parent} ({shown})"
        raise DigestMismatch(
            f"model '{spec.model.name}' weights digest mismatch: expected sha256 {expected}, got {actual} for {where}"
        )
    return actual
