"""A region's object store: where its replicas and result files live.

One small interface (``check``, ``put``, ``get``) over two kinds: an S3 bucket
at an endpoint (boto3, through an Airflow AWS connection when one is named,
else boto3's own chain: ``sources.s3_manifest.s3_client``) and a local path.
Objects are content-addressed by their writers, so a put of a key that exists
writes the same bytes again. Credentials are never in the ledger: the store's
settings there name a bucket, an endpoint and a connection id only.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from batch_inference.exceptions import BatchInferenceError
from batch_inference.regions.deployment import Store


class StoreUnavailable(BatchInferenceError, RuntimeError):
    """A region's store could not be reached (or refused us); one line, naming the store."""


def _first(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]


class ObjectStore:
    """``where`` names the store in messages."""

    where: str

    def check(self) -> None:
        """Reachable and writable, or StoreUnavailable."""
        raise NotImplementedError

    def put(self, key: str, data: bytes) -> None:
        raise NotImplementedError

    def get(self, key: str) -> bytes | None:
        """The object's bytes; None when there is no such object."""
        raise NotImplementedError


class PathStore(ObjectStore):
    def __init__(self, root: str):
        self.root = Path(root)
        self.where = str(self.root)

    def check(self) -> None:
        if not self.root.is_dir():
            raise StoreUnavailable(f"store {self.where}: no such directory")
        if not os.access(self.root, os.W_OK | os.X_OK):
            raise StoreUnavailable(f"store {self.where}: not writable")

    def put(self, key: str, data: bytes) -> None:
        self.check()             # a root that is gone is a store lost, never one to make again
        path = self.root / key
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".put-")
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)     # whole or not at all
        except OSError as exc:
            raise StoreUnavailable(f"store {self.where}: cannot write {key}: {exc.strerror}") from None

    def get(self, key: str) -> bytes | None:
        if not self.root.is_dir():
            raise StoreUnavailable(f"store {self.where}: no such directory")
        try:
            return (self.root / key).read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StoreUnavailable(f"store {self.where}: cannot read {key}: {exc.strerror}") from None


class S3Store(ObjectStore):
    def __init__(self, bucket: str, endpoint: str | None = None, conn_id: str | None = None):
        self.bucket, self.endpoint, self.conn_id = bucket, endpoint, conn_id
        self.where = f"s3://{bucket}" + (f" at {endpoint}" if endpoint else "")
        self._client: Any = None

    def client(self) -> Any:
        if self._client is None:
            from batch_inference.sources.s3_manifest import s3_client

            try:
                self._client = s3_client(self.conn_id, self.endpoint)
            except BatchInferenceError as exc:
                raise StoreUnavailable(f"store {self.where}: {exc}") from None
        return self._client

    def _call(self, what: str, fn: Any, **kw: Any) -> Any:
        try:
            return fn(Bucket=self.bucket, **kw)
        except Exception as exc:  # noqa: BLE001 - botocore's errors: refused, unreachable, denied
            code = getattr(exc, "response", {}).get("Error", {}).get("Code") if hasattr(exc, "response") else None
            if code in ("NoSuchKey", "404") and what == "get":
                return None
            raise StoreUnavailable(f"store {self.where}: {what} failed: {_first(exc)}") from None

    def check(self) -> None:
        self._call("head bucket", self.client().head_bucket)

    def put(self, key: str, data: bytes) -> None:
        self._call("put", self.client().put_object, Key=key, Body=data)

    def get(self, key: str) -> bytes | None:
        r = self._call("get", self.client().get_object, Key=key)
        return None if r is None else r["Body"].read()


def store_for(settings: Store | dict[str, Any]) -> ObjectStore:
    """The store a deployment's (or the ledger's stored) settings name."""
    s = settings if isinstance(settings, Store) else Store.model_validate(settings)
    if s.kind == "s3":
        return S3Store(s.bucket or "", s.endpoint, s.conn_id)
    return PathStore(s.path or "")


def key_for(settings: Store | dict[str, Any], job_version: str, kind: str, digest: str) -> str:
    """A content-addressed key: ``PREFIX/JOB/KIND/SHA256.parquet`` (S3) or ``JOB/KIND/SHA256.parquet`` (a path)."""
    s = settings if isinstance(settings, Store) else Store.model_validate(settings)
    tail = f"{job_version}/{kind}/{digest}.parquet"
    return f"{s.prefix.strip('/')}/{tail}" if s.kind == "s3" and s.prefix.strip("/") else tail
