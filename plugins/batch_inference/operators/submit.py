"""``SubmitJobOperator``: spec -> snapshot -> plan, in one transaction.

A thin shell over ``batch_inference.plan.submit``. The task's XCom is the
small manifest (job version, records, shards, dead letters, reused), never
records; the job version is also pushed under the key ``job_version`` so
downstream tasks can take ``submit.output["job_version"]``, and recorded in
the ledger against the DAG run (``bi.job_runs``), created or resumed, where the
on-call callbacks find it. After a success it reports OpenLineage datasets:
the source table (or S3 manifest) in, the ledger's ``bi.snapshot_rows`` out.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from airflow.sdk import BaseOperator, Context
from airflow.sdk.exceptions import AirflowFailException

from batch_inference import db
from batch_inference.hooks.batch_inference import BatchInferenceHook, LedgerTask
from batch_inference.operators.lineage import Ident, operator_lineage, s3_ident, table_ident

# Spec fields a DAG run may override without editing the spec file. All but
# `incremental`, `dataset` and engine options that change results
# (batch_inference.engines.pinned_options) leave the spec hash alone; an
# override that does change results (`prompt`, `params`, ...) is refused here:
# it belongs in a reviewed spec, and it would be a new job version anyway.
# `endpoints` and `cleared_for_hosted` are not overridable: only the spec
# declares an endpoint internal or a record class cleared.
OVERRIDABLE = frozenset({
    "shard_size", "max_attempts", "lease_seconds", "renew_seconds", "incremental", "validation", "fallback",
    "cost", "autopilot", "engine", "dataset",
})


def _int_or_none(value: Any, name: str) -> int | None:
    """Params rendered through Jinja arrive as strings; an empty one means "not set"."""
    if value is None or (isinstance(value, str) and value.strip() in ("", "None")):
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        raise AirflowFailException(f"{name} must be an integer, got {value!r}") from None


def resolve_spec_path(path: str, dag_fileloc: str | None) -> Path:
    """A relative spec path is looked up next to the DAG file, then in the working directory."""
    p = Path(os.path.expanduser(path))
    if p.is_absolute():
        return p
    if dag_fileloc:
        beside = Path(dag_fileloc).resolve().parent / p
        if beside.exists():
            return beside
    return p.resolve()


def dag_run_ids(context: Context | None) -> tuple[str, str] | None:
    """(dag_id, run_id) of the running task, or None outside a DAG run."""
    if not context:
        return None
    for holder in (context.get("dag_run"), context.get("ti")):
        dag_id, run_id = getattr(holder, "dag_id", None), getattr(holder, "run_id", None)
        if dag_id and run_id:
            return str(dag_id), str(run_id)
    return None


def record_job_run(conn, dag_id: str, run_id: str, job_version: str, created: bool) -> None:
    """Note in the ledger which job version this DAG run works on (``bi.job_runs``)."""
    conn.execute(db.q("job_run_record"), {"dag_id": dag_id, "run_id": run_id, "job": job_version,
                                          "created": created})


class SubmitJobOperator(LedgerTask, BaseOperator):
    """Validate a job spec, snapshot its source and plan the shards.

    Submitting the same spec over the same rows again returns the existing job
    version and writes nothing (the version is a content hash), so a retried
    or re-run task is safe. If an earlier DAG run that Airflow still has queued
    or running works on the same job version (``bi.job_runs``), this run waits
    for it, deferred: two backfill runs over unchanged rows run one after the
    other, never side by side.

    :param spec: path to a spec YAML/JSON file (relative paths are resolved
        next to the DAG file), or the spec as a dict. Templated.
    :param postgres_conn_id: Airflow connection of the ledger database. Templated.
    :param shard_size: override ``spec.shard_size`` (e.g. ``"{{ params.shard_size }}"``). Templated.
    :param source_table: override the source with this PostgreSQL table
        (``schema.table``), keeping the spec's column names. Templated.
    :param incremental: override ``spec.incremental`` (reuse results of
        unchanged records from the last validated version). Templated.
    :param overrides: other spec fields to override, limited to those that do
        not change results (see ``OVERRIDABLE``). Templated.
    :param aws_conn_id: Airflow AWS connection for ``s3_manifest`` and S3 ``parquet`` sources
        (default: the spec's ``source.conn_id``). Templated. A ``sql`` source reads through
        ``source.conn_id``: any connection whose hook is a common-sql ``DbApiHook``.
    :param s3_endpoint_url: S3-compatible endpoint; usually the AWS
        connection's ``endpoint_url`` extra instead. Templated.
    :param wait_poll_seconds: when an earlier DAG run (of any DAG) is still working on a version of the
        same dataset (this job version or another), this run waits, deferred, until that run has ended
        (the triggerer reads its state every this many seconds) or five minutes have passed
        (``triggers.earlier_run``), then checks again: one dataset's runs
        work and publish in the order they submitted, while other datasets' runs go on beside them.
    :param deployment: a deployment YAML (clusters in several regions, docs/regions.md; relative paths
        next to the DAG file), or empty: every store and Kubernetes connection is asked before anything is
        written, then the snapshot is replicated near each cluster (``plan.submit``'s ``deployment``); the
        manifest's ``regions`` says what replication cost. Templated.
    """

    template_fields: Sequence[str] = ("spec", "postgres_conn_id", "shard_size", "source_table", "incremental",
                                      "overrides", "aws_conn_id", "s3_endpoint_url", "deployment")
    template_fields_renderers = {"spec": "json", "overrides": "json"}
    ui_color = "#f5d195"

    def __init__(self, *, spec: str | Mapping[str, Any], postgres_conn_id: str = BatchInferenceHook.default_conn_name,
                 shard_size: int | str | None = None, source_table: str | None = None,
                 incremental: bool | str | None = None, overrides: Mapping[str, Any] | None = None,
                 aws_conn_id: str | None = None, s3_endpoint_url: str | None = None,
                 wait_poll_seconds: float = 5.0, deployment: str | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.deployment = deployment
        self.spec = spec
        self.postgres_conn_id = postgres_conn_id
        self.shard_size = shard_size
        self.source_table = source_table
        self.incremental = incremental
        self.overrides = dict(overrides or {})
        self.aws_conn_id = aws_conn_id
        self.s3_endpoint_url = s3_endpoint_url
        self.wait_poll_seconds = wait_poll_seconds
        self._lineage: tuple[list[Ident], list[Ident]] | None = None

    def _dag_fileloc(self, context: Context | None) -> str | None:
        dag = context.get("dag") if context else None
        if dag is None:
            try:
                dag = self.dag
            except RuntimeError:  # not assigned to a DAG (a bare operator in a test)
                return None
        return getattr(dag, "fileloc", None)

    def load_spec(self, context: Context | None = None):
        """The spec with this task's overrides applied (a new frozen JobSpec)."""
        from batch_inference.spec import SpecError, load_spec, parse_spec

        try:
            if isinstance(self.spec, Mapping):
                data = dict(self.spec)
            else:
                path = resolve_spec_path(str(self.spec), self._dag_fileloc(context))
                data = load_spec(path).model_dump(mode="json")
            unknown = set(self.overrides) - OVERRIDABLE
            if unknown:
                raise AirflowFailException(f"overrides {sorted(unknown)} change results; edit the spec instead "
                                           f"(overridable: {', '.join(sorted(OVERRIDABLE))})")
            data.update(self.overrides)
            shard_size = _int_or_none(self.shard_size, "shard_size")
            if shard_size is not None:
                data["shard_size"] = shard_size
            if self.incremental not in (None, ""):
                data["incremental"] = str(self.incremental).lower() in ("1", "true", "yes", "on")
            if self.source_table:
                src = dict(data["source"])
                src.update({"kind": "postgres", "table": str(self.source_table), "query": None, "s3_manifest": None})
                data["source"] = src
            return parse_spec(data)
        except SpecError as exc:
            # A bad spec does not get better on retry.
            raise AirflowFailException(str(exc)) from None

    def execute(self, context: Context) -> dict[str, Any]:
        from batch_inference.snapshot import SnapshotError

        from batch_inference.sources import for_spec

        spec = self.load_spec(context)
        deployment = self.load_deployment(context)
        # Any source kind: a PostgreSQL table or query, an S3 manifest, any common-sql connection
        # (kind sql), Parquet files, an Iceberg snapshot (batch_inference.sources).
        reader = for_spec(spec, s3_endpoint_url=self.s3_endpoint_url, aws_conn_id=self.aws_conn_id)
        hook = self.ledger_hook(self.postgres_conn_id)
        run = dag_run_ids(context)
        try:
            with hook.get_conn() as conn:
                manifest = self._submit(conn, spec, reader, deployment)
                if run:
                    record_job_run(conn, *run, manifest["job_version"], manifest["created"])
                    busy = self._earlier_active_run(conn, context, manifest["job_version"], *run)
        except SnapshotError as exc:
            raise AirflowFailException(f"snapshot refused: {exc}") from None
        if run and busy:
            # Two runs on one job version side by side would race each other's workers, validation and
            # publish, and two versions of one dataset would publish in whichever order they finish (an
            # older snapshot last): this one waits its turn, whatever DAG the earlier run belongs to.
            self.log.info("job version %s of dataset %s: the dataset is being worked by the earlier run "
                          "%s/%s; this run waits for it to end (its state read every %.0f s)",
                          manifest["job_version"], spec.dataset, *busy, self.wait_poll_seconds)
            from batch_inference.triggers.earlier_run import EarlierRunTrigger

            # The triggerer reads the earlier run's state (no task process while it waits); back here once
            # it has ended, or after the trigger's bound (a run deleted meanwhile never ends), the submit
            # checks again for any earlier run still active.
            self.defer(trigger=EarlierRunTrigger(busy[0], busy[1], poll_interval=self.wait_poll_seconds),
                       method_name="execute_after_wait")
        self._lineage = self._datasets(spec.source, hook.get_conninfo(), reader)
        self.log.info("%s %s: %d records in %d shard(s), %d dead letters at planning, %d reused",
                      "submitted" if manifest["created"] else "already submitted", manifest["job_version"],
                      manifest["records"], manifest["shards"], manifest["dead_letters_at_planning"],
                      manifest["reused"])
        context["ti"].xcom_push(key="job_version", value=manifest["job_version"])
        return manifest

    def load_deployment(self, context: Context | None = None) -> Any:
        """The deployment this task submits onto, or None (no ``deployment``); a bad file fails the task."""
        from batch_inference.regions import DeploymentError, load_deployment

        path = str(self.deployment or "").strip()
        if not path or path == "None":
            return None
        try:
            return load_deployment(resolve_spec_path(path, self._dag_fileloc(context)))
        except DeploymentError as exc:
            raise AirflowFailException(str(exc)) from None

    def _submit(self, conn: Any, spec: Any, reader: Any, deployment: Any) -> dict[str, Any]:
        from batch_inference.plan import submit
        from batch_inference.regions import DeploymentError

        try:
            manifest = submit(conn, spec, reader=reader, deployment=deployment).as_dict()
        except DeploymentError as exc:   # a store or connection that does not answer: nothing written
            raise AirflowFailException(str(exc)) from None
        for region, c in (manifest.get("regions") or {}).get("regions", {}).items():
            self.log.info("region %s: %d shard replicas, %d bytes in %.2f s, $%.4f egress", region, c["shards"],
                          c["bytes"], c["seconds"], c["usd"])
        return manifest

    def execute_after_wait(self, context: Context, event: Any = None) -> dict[str, Any]:
        """Back from waiting for an earlier run of the same dataset: submit again (it finds the version)."""
        return self.execute(context)

    def _earlier_active_run(self, conn: Any, context: Context, job_version: str, dag_id: str,
                            run_id: str) -> tuple[str, str] | None:
        """An earlier DAG run on a version of this job version's dataset that Airflow still has queued or
        running, if any."""
        ti = context.get("ti")
        if ti is None or not hasattr(ti, "get_dagrun_state"):
            return None
        for other in conn.execute(db.q("job_runs_earlier"), {"job": job_version, "dag_id": dag_id,
                                                              "run_id": run_id}).fetchall():
            try:
                state = ti.get_dagrun_state(other["dag_id"], other["run_id"])
            except Exception:  # noqa: BLE001 - a run Airflow no longer knows (db clean) is not active
                continue
            if str(state).lower().rsplit(".", 1)[-1] in ("queued", "running"):
                return other["dag_id"], other["run_id"]
        return None

    @staticmethod
    def _datasets(source, conninfo: str, reader: Any = None) -> tuple[list[Ident], list[Ident]]:
        if reader is not None and source.kind != "postgres":
            inputs = reader.lineage()   # named by the source's own module (batch_inference.sources)
        elif source.kind == "s3_manifest":
            inputs = [s3_ident(source.s3_manifest)]
        elif source.table:
            inputs = [table_ident(conninfo, source.table)]
        else:  # a query: its tables are not named here
            inputs = []
        return inputs, [table_ident(conninfo, "bi.snapshot_rows")]

    def lineage_datasets(self) -> tuple[list[Ident], list[Ident]] | None:
        """(inputs, outputs) of the last execute as (namespace, name) pairs; None before one."""
        return self._lineage

    def get_openlineage_facets_on_complete(self, task_instance: Any) -> Any:
        """OpenLineage: the source in, the ledger's snapshot table out (None without OpenLineage)."""
        datasets = self.lineage_datasets()
        return operator_lineage(*datasets) if datasets else None
