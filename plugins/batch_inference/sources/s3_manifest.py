"""``kind: s3_manifest``: read a manifest of JSONL objects in S3 as rows.

A job whose ``source.kind`` is ``s3_manifest`` names ``s3://bucket/manifest.json``.
The manifest lists the objects that make up the input, either as a JSON list
or as ``{"objects": [...]}``; each entry is a key in the manifest's bucket, a
full ``s3://bucket/key``, or an object ``{"key": ..., "version_id": ...,
"etag": ...}``. A ``version_id`` reads that exact version of a versioned
bucket; an ``etag`` makes the read fail if the object changed after the
manifest was written. Each object is JSON Lines (``.gz`` is decompressed),
one record per line, with the spec's ``id_column``, ``text_column`` (or
``columns``) and ``acl_column`` fields. What pins the input is the manifest
itself: its ``version_id`` and ``etag`` entries.

``s3_manifest_rows`` yields ``{"record_id", "text", "acl"}`` dicts lazily;
``plan.submit(conn, spec, rows=...)`` copies them into the ledger in the
submit transaction, so the job never reads the objects again: rewriting or
deleting them later changes nothing about the job version.

Credentials come from an Airflow AWS connection (``aws_conn_id``, read by the
amazon provider's ``S3Hook``; an S3-compatible store's address goes in the
connection's extra as ``endpoint_url``), or, with no connection id, from
boto3's own chain (environment, instance profile) plus ``endpoint_url``.
"""

from __future__ import annotations

import gzip
import json
import logging
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlparse

from batch_inference.snapshot import SnapshotError
from batch_inference.sources.base import Ident, Reader, record
from batch_inference.spec import Source

log = logging.getLogger(__name__)


def parse_s3_url(url: str) -> tuple[str, str]:
    """``s3://bucket/key`` -> (bucket, key)."""
    p = urlparse(url)
    if p.scheme not in ("s3", "s3a") or not p.netloc or not p.path.strip("/"):
        raise SnapshotError(f"not an s3://bucket/key URL: {url!r}")
    return p.netloc, p.path.lstrip("/")


def s3_client(aws_conn_id: str | None = None, endpoint_url: str | None = None) -> Any:
    """A boto3 S3 client: through the Airflow connection if one is named."""
    if aws_conn_id:
        from airflow.providers.amazon.aws.hooks.s3 import S3Hook

        hook = S3Hook(aws_conn_id=aws_conn_id)
        if endpoint_url:  # an explicit endpoint wins over the connection's extra
            return hook.get_session().client("s3", endpoint_url=endpoint_url, config=hook.config,
                                              verify=hook.verify)
        return hook.get_conn()
    try:
        import boto3
    except ImportError:
        raise SnapshotError("an s3_manifest source needs boto3 (pip install "
                            "'airflow-provider-batch-inference[airflow]')") from None
    return boto3.session.Session().client("s3", endpoint_url=endpoint_url)


def _entries(manifest: Any, url: str) -> list[dict[str, Any]]:
    items = manifest.get("objects") if isinstance(manifest, dict) else manifest
    if not isinstance(items, list):
        raise SnapshotError(f"manifest {url}: expected a JSON list of object keys or {{\"objects\": [...]}}")
    out = []
    for i, item in enumerate(items):
        entry = {"key": item} if isinstance(item, str) else item
        if not isinstance(entry, dict) or not isinstance(entry.get("key"), str) or not entry["key"]:
            raise SnapshotError(f"manifest {url}: entry {i} is not a key or an object with a 'key'")
        out.append(entry)
    if not out:
        raise SnapshotError(f"manifest {url} lists no objects")
    return out


def client_error(exc: Exception) -> str:
    err = getattr(exc, "response", {}).get("Error", {}) if hasattr(exc, "response") else {}
    return f"{err.get('Code', exc.__class__.__name__)}: {err.get('Message', str(exc))}"


def _get(client: Any, bucket: str, key: str, version_id: str | None = None, etag: str | None = None) -> bytes:
    kwargs: dict[str, Any] = {"Bucket": bucket, "Key": key}
    if version_id:
        kwargs["VersionId"] = version_id
    if etag:
        kwargs["IfMatch"] = etag if etag.startswith('"') else f'"{etag}"'
    try:
        body = client.get_object(**kwargs)["Body"].read()
    except Exception as exc:  # botocore's ClientError and friends; re-raised as one readable line
        raise SnapshotError(f"cannot read s3://{bucket}/{key}: {client_error(exc)}") from None
    return gzip.decompress(body) if key.endswith(".gz") else body


def _objects(source: Source, endpoint_url: str | None = None,
             aws_conn_id: str | None = None) -> Iterator[dict[str, Any]]:
    """Every JSON object of every line of every object the manifest lists, one object in memory at a time."""
    if not source.s3_manifest:
        raise SnapshotError("source has no s3_manifest")
    client = s3_client(aws_conn_id or source.conn_id, endpoint_url)
    bucket, key = parse_s3_url(source.s3_manifest)
    raw = _get(client, bucket, key)
    try:
        manifest = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise SnapshotError(f"manifest {source.s3_manifest} is not JSON: {exc}") from None
    entries = _entries(manifest, source.s3_manifest)
    total = 0
    for entry in entries:
        obj_bucket, obj_key = (parse_s3_url(entry["key"]) if entry["key"].startswith("s3")
                               and "://" in entry["key"] else (bucket, entry["key"]))
        data = _get(client, obj_bucket, obj_key, entry.get("version_id"), entry.get("etag"))
        n = 0
        for lineno, line in enumerate(data.splitlines(), 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line.decode("utf-8"))
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise SnapshotError(f"s3://{obj_bucket}/{obj_key} line {lineno}: not JSON ({exc})") from None
            if not isinstance(rec, dict):
                raise SnapshotError(f"s3://{obj_bucket}/{obj_key} line {lineno}: expected a JSON object")
            yield rec
            n += 1
        total += n
        log.info("read %d record(s) from s3://%s/%s", n, obj_bucket, obj_key)
    log.info("manifest %s: %d object(s), %d record(s)", source.s3_manifest, len(entries), total)


def s3_manifest_rows(source: Source, endpoint_url: str | None = None,
                     aws_conn_id: str | None = None) -> Iterator[dict[str, Any]]:
    """Yield ``{"record_id", "text", "acl"}`` for every line of every object the manifest lists.

    ``aws_conn_id`` defaults to ``source.conn_id``. Objects are read one at a
    time, so memory holds one object, not the snapshot.
    """
    for rec in _objects(source, endpoint_url, aws_conn_id):
        rid = rec.get(source.id_column)
        yield {
            "record_id": None if rid is None else str(rid),
            "text": rec.get(source.text_column),
            "acl": rec.get(source.acl_column) if source.acl_column else None,
        }


class S3Manifest(Reader):
    """JSON Lines objects listed in a manifest; one ``text_column`` is read as it always was, several
    ``columns`` become one record each (``sources.record``)."""

    kind = "s3_manifest"

    def rows(self) -> Iterator[dict[str, Any]]:
        src = self.source
        if not src.columns:
            return s3_manifest_rows(src, self.s3_endpoint_url, self.aws_conn_id)
        return self._records()

    def _records(self) -> Iterator[dict[str, Any]]:
        src = self.source
        for rec in _objects(src, self.s3_endpoint_url, self.aws_conn_id):
            try:
                yield record(self.spec, rec.get(src.id_column), [rec.get(c) for c in src.record_columns],
                             rec.get(src.acl_column) if src.acl_column else None)
            except TypeError as exc:
                raise self.refuse(f"record {rec.get(src.id_column)!r}: {exc}") from None

    def lineage(self) -> list[Ident]:
        bucket, key = parse_s3_url(self.source.s3_manifest or "")
        return [(f"s3://{bucket}", key)]
