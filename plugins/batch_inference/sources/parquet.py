"""``kind: parquet``: Parquet files, local or on S3, each file pinned as the manifest pins its objects.

``source.paths`` names files or prefixes (a local directory, ``s3://bucket/prefix/``).
At submit every file is listed and pinned: an S3 object by its ETag (and its
version id on a versioned bucket), a local file by its size and modification
time. The pins are recorded with the job (its stored spec's ``source.paths``
become the pinned entries), so a resubmit of that spec reads exactly those
files or fails: an S3 object is read with ``If-Match`` (or its version id),
a local file is checked before and after it is read, and one that changed
after it was listed is refused in one line.

Files are read one at a time, one row group batch at a time
(``ROWS_PER_FETCH`` rows); an S3 object is first copied to a temporary file,
so memory holds one batch, not a file. Credentials come from an Airflow AWS
connection (``aws_conn_id``, else ``source.conn_id``) or boto3's own chain.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from batch_inference.exceptions import SnapshotError
from batch_inference.sources.base import ROWS_PER_FETCH, Ident, Reader, Records, column_batch, read_columns
from batch_inference.sources.s3_manifest import client_error, parse_s3_url, s3_client

log = logging.getLogger(__name__)


class ParquetFiles(Reader):
    """Parquet files or prefixes; pinned per file."""

    kind = "parquet"

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._files: list[dict[str, Any]] | None = None
        self._client: Any = None

    def client(self) -> Any:
        if self._client is None:
            self._client = s3_client(self.aws_conn_id or self.source.conn_id,
                                     self.s3_endpoint_url or self.source.s3_endpoint)
        return self._client

    # -- listing and pinning
    def files(self) -> list[dict[str, Any]]:
        """Every file the paths name, each with its pin (listed once)."""
        if self._files is None:
            out: list[dict[str, Any]] = []
            for entry in self.source.paths or []:
                pinned = entry if isinstance(entry, dict) else None
                path = pinned["path"] if pinned else entry
                out.extend([pinned] if pinned else (self._s3_list(path) if path.startswith("s3://")
                                                    else self._local_list(path)))
            if not out:
                raise self.refuse("no Parquet files under the paths given")
            self._files = out
        return self._files

    def _local_list(self, path: str) -> list[dict[str, Any]]:
        p = Path(path.removeprefix("file://"))
        if p.is_dir():
            found = sorted(f for f in p.rglob("*.parquet") if f.is_file())
        elif p.is_file():
            found = [p]
        else:
            raise self.refuse(f"{path}: no such file or directory")
        return [{"path": str(f), "size": (st := f.stat()).st_size, "mtime_ns": st.st_mtime_ns} for f in found]

    def _s3_list(self, url: str) -> list[dict[str, Any]]:
        bucket, key = parse_s3_url(url) if url.rstrip("/") != url.split("://")[0] + "://" else (url[5:], "")
        client = self.client()
        try:
            if not key.endswith("/"):
                try:
                    head = client.head_object(Bucket=bucket, Key=key)
                    return [_s3_pin(bucket, key, head)]
                except Exception as exc:  # noqa: BLE001 - not an object: a prefix
                    if "404" not in str(exc) and "Not Found" not in str(exc) and "NoSuchKey" not in str(exc):
                        raise
            out = []
            for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=key):
                for obj in page.get("Contents", []):
                    if obj["Key"].endswith(".parquet"):
                        head = client.head_object(Bucket=bucket, Key=obj["Key"])
                        out.append(_s3_pin(bucket, obj["Key"], head))
            return sorted(out, key=lambda f: f["path"])
        except SnapshotError:
            raise
        except Exception as exc:  # noqa: BLE001 - botocore's errors: one line
            raise self.refuse(f"cannot list {url}: {client_error(exc)}") from None

    def pin(self) -> dict[str, Any]:
        return {"paths": self.files()}

    # -- reading
    def check(self) -> None:
        self.files()

    def rows(self) -> Records:
        return Records(self._batches())

    def _batches(self) -> Iterator[Any]:
        import pyarrow.parquet as pq

        cols = read_columns(self.source)
        for f in self.files():
            with self._opened(f) as local:
                try:
                    # pre_buffer off: with it, iter_batches keeps what it read ahead for the whole
                    # file (its size in memory: 187 MiB for a 186 MiB file of 10M rows), and reads no faster here.
                    pf = pq.ParquetFile(local, pre_buffer=False)
                except Exception as exc:  # noqa: BLE001 - not Parquet
                    raise self.refuse(f"{f['path']}: not a Parquet file ({exc})") from None
                names = pf.schema_arrow.names
                missing = [c for c in cols if c not in names]
                if missing:
                    raise self.refuse(f"{f['path']}: no column {missing[0]!r} (it has {', '.join(names[:20])})")
                n = 0
                for batch in pf.iter_batches(batch_size=ROWS_PER_FETCH, columns=cols):
                    yield column_batch(self, {c: batch.column(c) for c in cols}, f"{f['path']}: ")
                    n += batch.num_rows
                log.info("read %d record(s) from %s", n, f["path"])
            if not f["path"].startswith("s3://"):
                self._unchanged(f)

    def _unchanged(self, f: dict[str, Any]) -> None:
        try:
            st = os.stat(f["path"])
        except OSError:
            raise self.refuse(f"{f['path']} changed after it was listed (it is gone)") from None
        if (f.get("size") is not None and st.st_size != f["size"]) or (
                f.get("mtime_ns") is not None and st.st_mtime_ns != f["mtime_ns"]):
            raise self.refuse(f"{f['path']} changed after it was listed (size or modification time)")

    class _Opened:
        """A local path to read ``f`` from: the file itself, or an S3 object copied to a temporary file
        with its pin checked by S3 (``If-Match`` / ``VersionId``)."""

        def __init__(self, reader: "ParquetFiles", f: dict[str, Any]):
            self.reader, self.f = reader, f
            self.tmp: Any = None

        def __enter__(self) -> str:
            f, r = self.f, self.reader
            if not f["path"].startswith("s3://"):
                r._unchanged(f)
                return f["path"]
            bucket, key = parse_s3_url(f["path"])
            kw: dict[str, Any] = {"Bucket": bucket, "Key": key}
            if f.get("version_id"):
                kw["VersionId"] = f["version_id"]
            if f.get("etag"):
                kw["IfMatch"] = f["etag"] if f["etag"].startswith('"') else f'"{f["etag"]}"'
            try:
                body = r.client().get_object(**kw)["Body"]
            except Exception as exc:  # noqa: BLE001
                problem = client_error(exc)
                if "PreconditionFailed" in problem or "412" in problem:
                    raise r.refuse(f"{f['path']} changed after it was listed ({problem})") from None
                raise r.refuse(f"cannot read {f['path']}: {problem}") from None
            self.tmp = tempfile.NamedTemporaryFile(prefix="bi-parquet-", suffix=".parquet")
            shutil.copyfileobj(body, self.tmp, 1 << 20)
            self.tmp.flush()
            return self.tmp.name

        def __exit__(self, *exc: Any) -> None:
            if self.tmp is not None:
                self.tmp.close()

    def _opened(self, f: dict[str, Any]) -> "ParquetFiles._Opened":
        return ParquetFiles._Opened(self, f)

    def lineage(self) -> list[Ident]:
        """Each path as OpenLineage names files and objects: ``s3://bucket`` and the key, ``file`` and the
        path."""
        out: list[Ident] = []
        for entry in self.source.paths or []:
            path = entry["path"] if isinstance(entry, dict) else entry
            if path.startswith("s3://"):
                bucket, _, key = path[5:].partition("/")
                out.append((f"s3://{bucket}", key.rstrip("/")))
            else:
                out.append(("file", os.path.abspath(path.removeprefix("file://"))))
        return out


def _s3_pin(bucket: str, key: str, head: dict[str, Any]) -> dict[str, Any]:
    pin: dict[str, Any] = {"path": f"s3://{bucket}/{key}", "etag": head["ETag"].strip('"')}
    if head.get("VersionId") and head["VersionId"] != "null":
        pin["version_id"] = head["VersionId"]
    return pin
