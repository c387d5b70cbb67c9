"""Submit: spec -> snapshot -> plan, in one transaction.

A failed submit leaves nothing behind (the transaction rolls back, partitions
included). Submitting the same spec over the same rows returns the existing
job version and writes nothing (I2: the version is a content hash).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import psycopg
from psycopg import errors, sql

from batch_inference import destinations, snapshot, sources
from batch_inference.db import q
from batch_inference.engines import unenforced_line
from batch_inference.exceptions import BatchInferenceError, GrantRefused, RedriveRefused, SpecError
from batch_inference.sources import postgres as postgres_source
from batch_inference.spec import INT4_MAX, SETTINGS_UNDER_A_VERSION, JobSpec, settings_diff

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Manifest:
    """What a submit returns: small enough for an XCom, never records."""

    job_version: str
    dataset: str
    records: int
    shards: int
    dead_letters: int
    reused: int
    created: bool
    # A resubmit of an existing version: the settings outside the version it changed ("path: old -> new").
    applied: list[str] = field(default_factory=list)
    # The output schema's limits the engine cannot enforce while generating, in one line (engines.unenforced_line).
    not_enforced: str | None = None
    # Submitted onto a deployment of several regions: what placing it did (regions.place: per region, shards,
    # bytes, seconds and dollars of replication).
    regions: dict[str, Any] | None = None

    def as_dict(self) -> dict[str, Any]:
        """The manifest as JSON, its dead-letter count named for what it counts: the records refused at
        planning (too long, empty, ...), not those the workers dead-letter later (``status`` counts all)."""
        out = asdict(self)
        return {k if k != "dead_letters" else "dead_letters_at_planning": v for k, v in out.items()
                if k not in ("not_enforced", "regions") or v}


class _VersionTaken(BatchInferenceError, RuntimeError):
    """A concurrent submit of the same spec over the same rows committed the job version after this
    submit's snapshot was taken (two DAG runs triggered together): this one's insert met its row, and
    a submit again finds the version."""


def submit(conn: psycopg.Connection, spec: JobSpec,
           rows: Iterable[Mapping[str, Any]] | None = None, *,
           reader: sources.Reader | None = None, deployment: Any = None) -> Manifest:
    """Snapshot the source and plan shards. ``rows`` overrides the source (rows
    read elsewhere); otherwise ``reader`` (default: ``sources.for_spec(spec)``)
    checks the source before anything is written, pins it (what pins it is
    recorded in the job's stored spec) and streams its rows, or, for a
    PostgreSQL table or query, names the relation the ledger reads in SQL.
    ``deployment`` (a ``regions.Deployment``): every store and Kubernetes
    connection it names is asked first (``regions.DeploymentError``, nothing
    written), and the version is placed on it after (``regions.place``: each
    shard's replica written near its cluster; the manifest's ``regions``). The
    job version is the same with or without one (I2)."""
    if deployment is None:
        return _check_and_submit(conn, spec, rows, reader)
    from batch_inference.regions import check_reachable, place

    stores = check_reachable(deployment)
    m = _check_and_submit(conn, spec, rows, reader)
    return replace(m, regions=place(conn, m.job_version, deployment, stores=stores))


def _check_and_submit(conn: psycopg.Connection, spec: JobSpec, rows: Iterable[Mapping[str, Any]] | None,
                      reader: sources.Reader | None) -> Manifest:
    _check_engine(spec)                   # a dotted-path engine that does not resolve: one line, nothing written
    destinations.check_spec(conn, spec)   # an unreachable or uncleared destination: one line, nothing written
    if spec.task == "embed":
        from batch_inference import embed  # here: its numpy is no part of a submit that embeds nothing

        embed.check_spec(spec)            # a model of another size than embedding.dimensions: one line, nothing written
    not_enforced = unenforced_line(spec)  # the schema's limits the engine cannot enforce: one line, a warning
    if not_enforced:
        log.warning("%s", not_enforced)
    if rows is not None or spec.source.kind == "postgres":
        try:
            m = _submit(conn, spec, rows)
        except _VersionTaken:
            if rows is not None and not isinstance(rows, (list, tuple)):
                raise                             # rows read once: the caller submits again
            m = _submit(conn, spec, rows)         # a fresh snapshot: it finds the version, nothing written
        return replace(m, not_enforced=not_enforced)
    reader = reader or sources.for_spec(spec)
    if reader.ledger is None:
        reader.ledger = conn
    try:
        reader.check()                    # an unreachable source, an unknown table: one line, nothing written
        try:
            m = _submit(conn, reader.pinned(), reader.rows())
        except _VersionTaken:
            m = _submit(conn, reader.pinned(), reader.rows())
        return replace(m, not_enforced=not_enforced)
    finally:
        reader.close()


def _check_engine(spec: JobSpec) -> None:
    """A dotted-path engine resolves at submit (allowed module, importable, an Engine subclass), so a
    name that does not is refused here rather than first in a worker; a built-in name the spec checked."""
    from batch_inference.engines import BUILTIN_ENGINES, engine_class

    if spec.models:                       # a ladder: each rung's engine, and the confidence it must give
        from batch_inference.ladder import check_engines

        check_engines(spec)
    if spec.engine.name in BUILTIN_ENGINES:
        _check_hosted_engine(spec, engine_class(spec.engine.name))
        return
    try:
        engine_class(spec.engine.name)
    except ValueError as exc:
        raise SpecError(f"spec field 'engine.name': {exc}") from None


def _check_hosted_engine(spec: JobSpec, cls: type) -> None:
    """A hosted batch transport is built at submit (no call to the provider): a record class not cleared
    for it, an option it refuses or an output schema its provider cannot take is one line, nothing written."""
    if getattr(cls, "transport", None) != "hosted_batch" or spec.task != "generate":
        return
    try:
        cls(spec, spec.engine.options)
    except ValueError as exc:
        raise SpecError(f"spec field 'engine': {exc}") from None


def _submit(conn: psycopg.Connection, spec: JobSpec, rows: Iterable[Mapping[str, Any]] | None) -> Manifest:
    t0 = time.perf_counter()
    source_name = spec.source.label
    # A record of several columns was judged against max_input_chars where it was read
    # (sources.record, source_columns_relation): the snapshot's own cap is for one text column.
    cap = INT4_MAX if spec.source.columns else spec.max_input_chars
    # One transaction: nothing of it (staging tables included) outlives it,
    # so it runs through a transaction pooler (docs/capacity.md).
    with conn.transaction():
        conn.execute(q("repeatable_read"))
        if rows is not None:
            conn.execute(q("stage_create"))
            snapshot.stage_from_rows(conn, rows)
            relation: sql.Composable = snapshot.STAGE
        else:
            relation = postgres_source.relation(conn, spec, source_name)
        n, identity = snapshot.scan(conn, relation, source_name, spec.source.id_column)
        job = spec.job_version(identity)

        existing = conn.execute(q("job_manifest"), {"job": job}).fetchone()
        if existing:
            applied = _resubmitted(conn, job, existing["status"], spec)
            return Manifest(existing["job_version"], existing["dataset"], existing["records"],
                            existing["shards"], existing["dead_letters"], existing["reused"], created=False,
                            applied=applied)

        base = None
        if spec.incremental:
            r = conn.execute(q("base_for_reuse"), {"dataset": spec.dataset, "spec_hash": spec.spec_hash,
                                                   "job": job}).fetchone()
            base = r["job_version"] if r else None
        try:
            conn.execute(q("job_insert"), {
                "job": job, "dataset": spec.dataset, "spec_hash": spec.spec_hash, "snapshot_id": identity,
                "spec_text": json.dumps(spec.model_dump(mode="json")), "model_name": spec.model.name,
                "model_digest": spec.model.digest, "prompt_version": spec.prompt.version, "records": n,
                "base": base})
        except errors.UniqueViolation as exc:
            if exc.diag.constraint_name != "jobs_pkey":
                raise
            raise _VersionTaken(f"job version {job} was created by a concurrent submit of the same spec "
                                "over the same rows; submit again") from None
        part = conn.execute(q("job_partitions_create"), {"job": job}).fetchone()["p"]
        conn.execute(q("plan_work_mem"))
        params: dict[str, Any] = {"job": job, "base": base, "cap": cap,
                                  "shard_size": spec.shard_size}
        # A non-incremental run joins nothing: the reuse test folds to false.
        reuse = sql.SQL(q("snapshot_reuse" if base else "snapshot_no_reuse"))
        numbers = part + "_shard_no"   # the shard-number sequence, this transaction only
        conn.execute(sql.SQL(q("shard_numbers_create")).format(numbers=sql.Identifier("bi", numbers)))
        conn.execute(sql.SQL(q("snapshot_insert")).format(partition=sql.Identifier(part), relation=relation,
                                                          reuse=reuse, numbers=sql.Literal(f"bi.{numbers}")),
                     params)
        conn.execute(sql.SQL(q("shard_numbers_drop")).format(numbers=sql.Identifier("bi", numbers)))
        conn.execute(sql.SQL(q("snapshot_job_version")).format(partition=sql.Identifier(part), job=sql.Literal(job)))
        try:
            with conn.transaction():
                conn.execute(q("snapshot_attach"), {"job": job})
        except errors.UniqueViolation:
            raise snapshot.duplicates_error(conn, relation, source_name, spec.source.id_column) from None
        except errors.ProgramLimitExceeded:   # an id over the index's row size
            raise snapshot.long_id_error(conn, relation, source_name, spec.source.id_column) from None
        done = _plan(conn, params, n)
    m = Manifest(job, spec.dataset, done["records"], done["shards"], done["dead_letters"], done["reused"],
                 created=True)
    log.info("submitted %s: %d records, %d shards, %d dead letters at planning, %d reused%s in %.2fs",
             job, m.records, m.shards, m.dead_letters, m.reused, f" from {base}" if base else "",
             time.perf_counter() - t0)
    return m


def _resubmitted(conn: psycopg.Connection, job: str, status: str, spec: JobSpec) -> list[str]:
    """A spec submitted again over the same rows: its settings outside the job version that differ
    from the version's are applied when they may change under it (``SETTINGS_UNDER_A_VERSION``, on
    a version not yet published), else the submit is refused in one line, nothing written.
    Returns what was applied, ``path: old -> new`` each."""
    from batch_inference.status import job_spec

    diff = settings_diff(job_spec(conn, job), spec)
    # The same rows read from another source (a table here, a query or a warehouse there) are the same
    # snapshot: its content hash is in the job version, so where they were read from is nothing to apply.
    elsewhere = [path for path, _, _ in diff if path.split(".")[0] == "source"]
    if elsewhere:
        log.info("job version %s: the same rows read from another source (%s); the version keeps its own",
                 job, ", ".join(elsewhere))
    diff = [d for d in diff if d[0].split(".")[0] != "source"]
    if not diff:
        log.info("job version %s already exists for this spec and snapshot; nothing written", job)
        return []
    shown = [f"{path}: {json.dumps(a)} -> {json.dumps(b)}" for path, a, b in diff]
    fixed = [line for line, (path, _, _) in zip(shown, diff) if path.split(".")[0] not in SETTINGS_UNDER_A_VERSION]
    if fixed:
        raise SpecError(f"job version {job} already exists with other settings that cannot change under a version "
                        f"(its shards are planned): {'; '.join(fixed)}; submit with the version's values, or drop it "
                        f"first (batch-inference drop {job}) to plan it again")
    if status in ("published", "dropped"):
        raise SpecError(f"job version {job} is {status}: its settings stay as they are ({'; '.join(shown)}); a new "
                        "version needs a change that is part of it (prompt version, model, ...)")
    text = json.dumps(spec.model_dump(mode="json"))
    if conn.execute(q("job_settings_update"), {"job": job, "spec_hash": spec.spec_hash, "spec_text": text}
                    ).fetchone() is None:
        raise SpecError(f"job version {job} changed while this submit read it; submit again")
    log.warning("job version %s already exists; applied the changed settings: %s%s", job, "; ".join(shown),
                " (validate it again)" if status != "running" else "")
    return shown


def _plan(conn: psycopg.Connection, params: dict[str, Any], records: int) -> Mapping[str, Any]:
    """Dead letters, reused results, shard rows and the job's counts, from the
    snapshot's unsharded records alone (read through the shard index)."""
    u = conn.execute(q("plan_unsharded"), params).fetchone()
    assert u is not None
    if u["dead"]:
        conn.execute(q("plan_dead_letters"), params)
    if u["reused"]:
        conn.execute(q("plan_reuse"), params)
    done = conn.execute(q("plan_finish"), {**params, "records": records, "dead": u["dead"],
                                           "reused": u["reused"]}).fetchone()
    assert done is not None
    # Shards are numbered 0..n-1 in snapshot_insert; the shard sizes above
    # depend on it, so a numbering that ever disagrees stops the submit.
    last = -1 if u["last_shard"] is None else u["last_shard"]
    if done["shards"] != last + 1:
        raise RuntimeError(f"planning error: {done['shards']} shard rows for shard numbers 0..{last}")
    return done


def drop_job_version(conn: psycopg.Connection, job_version: str) -> bool:
    """Drop a job version's partitions and ledger rows, and its companion versions that serve
    no other version (``bi.drop_job_version_v1``), and an embedding version's search table, in one
    transaction; False if there is no such version.

    :raises PublishRefused: the version is published (roll its dataset back first); nothing is dropped.
    """
    from batch_inference import embed
    from batch_inference.publish import PublishRefused

    try:
        with conn.transaction():
            r = conn.execute(q("drop_job_version"), {"job": job_version}).fetchone()
            if r and r["dropped"]:
                embed.drop_search_table(conn, job_version)   # an embedding version's goes with it
    except errors.ObjectInUse as exc:
        raise PublishRefused(exc.diag.message_primary or str(exc).splitlines()[0]) from None
    return bool(r and r["dropped"])


def redrive_dead_letters(conn: psycopg.Connection, job_version: str, *, actor: str, reason: str,
                         stage: str | None = None, reason_like: str | None = None) -> dict[str, Any]:
    """Put the version's dead letters (of ``stage``, whose reason contains ``reason_like``, any
    case) back to pending with a fresh attempt budget, after their cause was fixed; recorded with
    who, when and why (``bi.redrive_dead_letters_v1``, ``bi.redrives``). Workers started on the
    version afterwards pick them up; only this call does it (I4: never automatic).

    :returns: id, job_version, records, shards, left_out (matched but refused before any worker), at.
    :raises RedriveRefused: no who or why, a published or dropped version, nothing matching, a
        matching shard leased now; nothing changed.
    :raises UnknownJob: no such version."""
    from batch_inference.status import UnknownJob

    try:
        with conn.transaction():
            row = conn.execute(q("redrive_dead_letters"), {"job": job_version, "actor": actor, "reason": reason,
                                                           "stage": stage, "reason_like": reason_like}).fetchone()
    except errors.NoDataFound as exc:
        msg = exc.diag.message_primary or str(exc).splitlines()[0]
        raise (UnknownJob if msg.startswith("no job version") else RedriveRefused)(msg) from None
    except (errors.ObjectNotInPrerequisiteState, errors.InvalidParameterValue) as exc:
        raise RedriveRefused(exc.diag.message_primary or str(exc).splitlines()[0]) from None
    log.warning("%s re-drove %d dead letter(s) of %s in %d shard(s): %s", actor, row["records"], job_version,
                row["shards"], reason)
    return dict(row)


def redrives(conn: psycopg.Connection, job_version: str, limit: int = 50) -> list[dict[str, Any]]:
    """The version's re-drives of dead letters, newest first."""
    return [dict(r) for r in conn.execute(q("redrives"), {"job": job_version, "n": limit})]


def grant_job(conn: psycopg.Connection, role: str, job_version: str, *, revoke: bool = False) -> bool:
    """Let ``role`` (a worker login role or group in ``bi_worker``) work on ``job_version``,
    or with ``revoke`` take it back. Idempotent: True if this call changed the grants.

    :raises GrantRefused: no such role, or a role outside ``bi_worker``.
    :raises UnknownJob: no such job version.
    """
    from batch_inference.status import UnknownJob

    try:
        r = conn.execute(q("revoke_job" if revoke else "grant_job"), {"role": role, "job": job_version}).fetchone()
    except errors.ForeignKeyViolation:
        raise UnknownJob(f"no job version {job_version!r}") from None
    except (errors.UndefinedObject, errors.InvalidGrantOperation) as exc:
        raise GrantRefused(exc.diag.message_primary or str(exc).splitlines()[0]) from None
    return bool(r and r["changed"])
