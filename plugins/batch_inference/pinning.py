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
* a model directory (``sha256_tree``): the same lines for EVERY file below
  it, named by its path relative to the directory (``tokenizer/vocab.json``),
  sorted by those paths' UTF-8 bytes. Weights, config, tokenizer, chat
  template and generation config are all in it, so a change to any file, an
  added file or a moved one is a different digest. In the directory::

      find . -type f ! -path ./SHA256SUMS -printf '%P\\n' | LC_ALL=C sort | xargs -d '\\n' sha256sum | sha256sum

  (the same with links followed: ``find -L``). Links are followed, a
  directory loop, a special file (FIFO, device) or a file name holding a
  newline or backslash is refused, and so is every code file
  (``CODE_SUFFIXES``, ``*.so.N``; a link to one counts) unless the spec
  lists it in ``model.code_files``: a model that runs its own code is
  pinned only when the spec says so.

A model directory may hold those lines as a file, ``SHA256SUMS`` at its top
(``MANIFEST_NAME``; ``write_manifest`` writes it). It is left out of the
digest, so the digest is simply ``sha256sum SHA256SUMS`` and
``sha256sum -c SHA256SUMS`` checks the files with standard tools. When the
directory does not match the pin and its manifest does (the manifest is the
pinned one), the refusal names each file that changed, went missing or was
added; a manifest that does not match the pin names nothing and is not
trusted. With no manifest the refusal gives the two digests only.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from batch_inference.exceptions import CodeInModel, DigestMismatch, WeightsMissing

if TYPE_CHECKING:
    from batch_inference.engines.base import Engine
    from batch_inference.spec import JobSpec

CHUNK = 1 << 20  # 1 MiB: large enough for full disk speed, small enough to stream multi-GB shards

# (path, size, mtime_ns) -> hex digest: a worker that loads the same weights
# for many shards hashes them once per process, and a changed file (new size
# or mtime) is hashed again.
_cache: dict[tuple[str, int, int], str] = {}


# Files a loader could execute: Python sources and bytecode, native libraries, scripts.
CODE_SUFFIXES = frozenset({".py", ".pyc", ".pyo", ".pyd", ".pyx", ".pxd", ".so", ".dylib", ".dll", ".exe",
                           ".sh", ".bash", ".bat", ".ps1", ".jar"})
_VERSIONED_LIB = re.compile(r"\.so(\.\d+)+$")


# The per-file digests of a model directory, in the directory itself (see the module docstring).
MANIFEST_NAME = "SHA256SUMS"


def is_code(name: str) -> bool:
    lower = name.lower()
    return os.path.splitext(lower)[1] in CODE_SUFFIXES or bool(_VERSIONED_LIB.search(lower))


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


def tree_files(root: str | os.PathLike[str], allowed_code: Iterable[str] = ()) -> list[tuple[str, Path]]:
    """Every file below ``root`` as (relative POSIX path, path), in digest order (see the module docstring)."""
    root = Path(root)
    if not root.is_dir():
        raise WeightsMissing(f"model directory not found: {root}")
    allowed = {str(p).strip("/") for p in allowed_code}
    found: list[tuple[str, Path]] = []

    def walk(directory: Path, rel: str, ancestors: frozenset[str]) -> None:
        try:
            entries = sorted(os.scandir(directory), key=lambda e: e.name)
        except OSError as exc:
            raise WeightsMissing(f"cannot read model directory {directory}: {exc.strerror}") from None
        for entry in entries:
            name = f"{rel}{entry.name}"
            if name == MANIFEST_NAME:
                continue
            if "\n" in name or "\\" in name:
                raise DigestMismatch(f"model directory {root}: file name {name!r} holds a newline or backslash")
            path = Path(entry.path)
            if entry.is_dir(follow_symlinks=True):
                real = os.path.realpath(path)
                if real in ancestors:
                    raise DigestMismatch(f"model directory {root}: {name} is a directory loop")
                walk(path, name + "/", ancestors | {real})
            elif entry.is_file(follow_symlinks=True):
                target = os.path.realpath(path) if entry.is_symlink() else ""
                if (is_code(entry.name) or (target and is_code(target))) and name not in allowed:
                    raise CodeInModel(f"model directory {root} holds the code file '{name}', which the spec does "
                                      "not declare in model.code_files; remove it or declare it")
                found.append((name, path))
            elif entry.is_symlink() and not path.exists():
                raise WeightsMissing(f"model directory {root}: {name} is a link to nothing")
            else:
                raise DigestMismatch(f"model directory {root}: {name} is not a regular file")

    walk(root, "", frozenset({os.path.realpath(root)}))
    if not found:
        raise WeightsMissing(f"model directory {root} holds no files")
    found.sort(key=lambda item: item[0].encode("utf-8", "surrogateescape"))
    return found


def sha256_tree(root: str | os.PathLike[str], allowed_code: Iterable[str] = ()) -> str:
    """The digest of a model directory: every file, by relative path (see the module docstring)."""
    return _tree_digest(tree_files(root, allowed_code))


def _manifest(tree: list[tuple[str, Path]]) -> bytes:
    return "".join(f"{sha256_file(p)}  {name}\n" for name, p in tree).encode("utf-8", "surrogateescape")


def _tree_digest(tree: list[tuple[str, Path]]) -> str:
    return hashlib.sha256(_manifest(tree)).hexdigest()


def write_manifest(root: str | os.PathLike[str], allowed_code: Iterable[str] = ()) -> str:
    """Write ``root/SHA256SUMS`` (every file's sha256, in digest order); returns the directory's digest."""
    data = _manifest(tree_files(root, allowed_code))
    (Path(root) / MANIFEST_NAME).write_bytes(data)
    return hashlib.sha256(data).hexdigest()


def _manifest_differences(root: Path, tree: list[tuple[str, Path]], expected: str) -> str:
    """What differs from the pinned manifest in ``root``, as one clause ('' when there is no trusted manifest)."""
    try:
        data = (root / MANIFEST_NAME).read_bytes()
    except OSError:
        return f" (no {MANIFEST_NAME} in the directory to name the files that differ)"
    if hashlib.sha256(data).hexdigest() != expected:
        return f" ({MANIFEST_NAME} in the directory is not the pinned one either)"
    pinned = {}
    for line in data.decode("utf-8", "surrogateescape").splitlines():
        digest, _, name = line.partition("  ")
        pinned[name] = digest
    actual = {name: sha256_file(p) for name, p in tree}
    changed = sorted(n for n in actual if n in pinned and pinned[n] != actual[n])
    missing = sorted(set(pinned) - set(actual))
    extra = sorted(set(actual) - set(pinned))
    parts = [f"{what} {', '.join(names[:5])}{', ...' if len(names) > 5 else ''}"
             for what, names in (("changed:", changed), ("missing:", missing), ("not in the pinned manifest:", extra))
             if names]
    return f": {'; '.join(parts)}" if parts else ""


def verify_weights(engine: "Engine", spec: "JobSpec") -> str | None:
    """Check the engine's weights against ``spec.model.digest``.

    Returns the digest checked, or None for a remote engine (no files: the
    endpoint's operator pins its model). Raises DigestMismatch naming the
    expected and actual digests and the file(s). An engine made of other
    engines (the model ladder's, ``parts()``) has each part checked against
    the part's own spec; the first digest checked is returned.
    """
    parts = getattr(engine, "parts", None)
    if callable(parts):
        checked = [verify_weights(part, part.spec) for part in parts()]
        return next((d for d in checked if d is not None), None)
    files = engine.weights_files()
    if not files:
        return None
    expected = spec.model.digest.removeprefix("sha256:")
    if len(files) == 1 and Path(files[0]).is_dir():
        tree = tree_files(files[0], spec.model.code_files)
        actual = _tree_digest(tree)
        if actual != expected:
            raise DigestMismatch(f"model '{spec.model.name}' digest mismatch: expected sha256 {expected}, got "
                                 f"{actual} for the {len(tree)} files of {files[0]}"
                                 f"{_manifest_differences(Path(files[0]), tree, expected)}")
        return actual
    actual = sha256_files(files)
    if actual != expected:
        names = sorted(Path(f).name for f in files)
        shown = ", ".join(names if len(names) <= 4 else [*names[:3], "..."])
        where = str(files[0]) if len(files) == 1 else f"{len(files)} files in {Path(files[0]).parent} ({shown})"
        raise DigestMismatch(
            f"model '{spec.model.name}' weights digest mismatch: expected sha256 {expected}, got {actual} for {where}"
        )
    return actual


def check_at_submit(spec: "JobSpec") -> str:
    """``submit``'s check of the pin, where the weights are reachable: the worker's own check
    (``verify_weights``) before any job version is written. Returns what was found, as ``submit``
    reports it ("verified sha256 ...", or "not checked: why"); raises DigestMismatch, with the next
    step, for weights that are here and do not match. Weights that are not here (a GPU pod's mount, a
    remote endpoint) are left to the worker, which checks them before it loads."""
    from batch_inference.engines import engine_for

    try:
        engine = engine_for(spec)
    except (ValueError, ImportError) as exc:   # an engine that cannot be built here (refused in its worker)
        return f"not checked: the engine cannot be built here ({' '.join(str(exc).split())})"
    try:
        checked = verify_weights(engine, spec)
    except WeightsMissing as exc:
        return f"not checked here ({exc}): each worker checks them before it loads"
    except CodeInModel:
        raise
    except DigestMismatch as exc:
        raise DigestMismatch(f"{exc}; nothing submitted: set model.digest to their `sha256sum`") from None
    if checked is None:
        return "not checked: the engine loads no weights files here (an endpoint serves its own model)"
    return f"verified sha256 {checked}"
