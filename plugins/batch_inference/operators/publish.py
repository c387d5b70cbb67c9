"""``PublishOperator`` and ``RollbackOperator``: switch the pointer downstream reads.

Thin shells over ``batch_inference.publish``. Downstream reads
``published.<dataset>``; publishing or rolling back is one guarded UPDATE of
the dataset's pointer, so readers see the old version or the new one, never
a mix. Both operators declare the dataset as an Airflow Asset in ``outlets``
(``dataset_asset``): when the switch succeeds Airflow records an asset event (and one for each Iceberg
destination declared as ``iceberg_asset``, its extra naming the snapshot),
and DAGs scheduled on that asset (a dashboard refresh, an index rebuild) run
on the new version. The event's ``extra`` (``switch_extra``) names the
version; the dashboard's rollback records an event of the same shape. After a
switch both report OpenLineage datasets: the ledger's ``bi.results`` in, the
view ``published.<dataset>`` out.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from airflow.sdk import Asset, BaseOperator, Context
from airflow.sdk.exceptions import AirflowFailException

from batch_inference.hooks.batch_inference import BatchInferenceHook, LedgerTask
from batch_inference.operators.lineage import Ident, iceberg_ident, operator_lineage, table_ident

ASSET_SCHEME = "batch-inference"


def dataset_asset(dataset: str) -> Asset:
    """The Asset that stands for a dataset's published view ``published.<dataset>``."""
    return Asset(name=f"batch_inference.{dataset}", uri=f"{ASSET_SCHEME}://published/{dataset}",
                 group="batch-inference")


def iceberg_asset(identifier: str, catalog: str = "ledger") -> Asset:
    """The Asset that stands for an Iceberg destination of a spec's ``publish.destinations``
    (its ``identifier`` and ``catalog.name``)."""
    return Asset(name=f"batch_inference.iceberg.{catalog}.{identifier}",
                 uri=f"{ASSET_SCHEME}://iceberg/{catalog}/{identifier}", group="batch-inference")


def _iceberg_uri(destination: str) -> str:
    """The ``iceberg_asset`` URI of a destination as the publish history names it (iceberg:CATALOG.TABLE)."""
    catalog, _, identifier = destination.removeprefix("iceberg:").partition(".")
    return iceberg_asset(identifier, catalog).uri


def _actor(context: Context) -> str:
    dag_run = context.get("dag_run")
    return f"airflow:{getattr(dag_run, 'dag_id', '?')}/{getattr(dag_run, 'run_id', '?')}"


def switch_extra(out: dict[str, Any]) -> dict[str, Any]:
    """The asset event's ``extra`` for a publish or rollback (``out`` of ``batch_inference.publish``)."""
    extra = {k: out.get(k) for k in ("dataset", "action", "from_version", "to_version", "changed", "view")}
    if out.get("destinations"):
        extra["destinations"] = [{k: d.get(k) for k in ("destination", "job_version", "snapshot_id")}
                                 for d in out["destinations"]]
    return extra


def _switch_datasets(postgres_conn_id: str, out: dict[str, Any] | None) -> tuple[list[Ident], list[Ident]] | None:
    """Lineage of a switch: the ledger's results in, the dataset's published view out; None before one."""
    if not out or not out.get("view"):
        return None
    conninfo = BatchInferenceHook(postgres_conn_id).get_conninfo()
    tables = [iceberg_ident(d["location"]) for d in out.get("destinations") or () if d.get("location")]
    return [table_ident(conninfo, "bi.results")], [table_ident(conninfo, str(out["view"])), *tables]


class _SwitchLineage:
    """OpenLineage for the operators that switch a dataset's pointer (they keep the switch in ``_out``)."""

    postgres_conn_id: str
    _out: dict[str, Any] | None

    def lineage_datasets(self) -> tuple[list[Ident], list[Ident]] | None:
        """(inputs, outputs) of the last switch as (namespace, name) pairs; None before one."""
        return _switch_datasets(self.postgres_conn_id, self._out)

    def get_openlineage_facets_on_complete(self, task_instance: Any) -> Any:
        """OpenLineage: ``bi.results`` in, ``published.<dataset>`` out (None without OpenLineage)."""
        datasets = self.lineage_datasets()
        return operator_lineage(*datasets) if datasets else None


def _annotate_events(op: BaseOperator, context: Context, out: dict[str, Any]) -> None:
    """Put the switch into the asset events Airflow emits for this task's outlets."""
    events = context.get("outlet_events")
    if events is None:
        return
    extra = switch_extra(out)
    tables = {_iceberg_uri(d["destination"]): d for d in out.get("destinations") or ()}
    for outlet in op.outlets or []:
        if isinstance(outlet, Asset) and outlet.uri in tables:
            events[outlet].extra.update({**switch_extra({**out, "destinations": None}),
                                         "snapshot_id": tables[outlet.uri].get("snapshot_id")})
        elif isinstance(outlet, Asset):
            if outlet.uri != f"{ASSET_SCHEME}://published/{out['dataset']}":
                op.log.warning("outlet %s does not name dataset %s's view", outlet.uri, out["dataset"])
            events[outlet].extra.update(extra)


class PublishOperator(_SwitchLineage, LedgerTask, BaseOperator):
    """Make a validated job version the one downstream reads.

    Publishing the version already published is a no-op, so a retried task
    writes no second history entry.

    :param job_version: the job version (templated; an XComArg works).
    :param dataset: the dataset the DAG expects; a version of another dataset is refused. Templated.
    :param force: publish although not validated; needs ``reason`` (recorded). Templated.
    :param reason: why, for the publish history. Templated.
    :param postgres_conn_id: Airflow connection of the ledger database. Templated.
    :param outlets: usually ``[dataset_asset(DATASET)]``; an asset event is recorded after the switch.
    """

    template_fields: Sequence[str] = ("job_version", "dataset", "force", "reason", "postgres_conn_id")
    ui_color = "#8dbb6f"

    def __init__(self, *, job_version: Any, dataset: str | None = None, force: bool | str = False,
                 reason: str | None = None, postgres_conn_id: str = BatchInferenceHook.default_conn_name,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.job_version = job_version
        self.dataset = dataset
        self.force = force
        self.reason = reason
        self.postgres_conn_id = postgres_conn_id
        self._out: dict[str, Any] | None = None

    def execute(self, context: Context) -> dict[str, Any]:
        from batch_inference.publish import PublishRefused, publish
        from batch_inference.status import UnknownJob

        force = self.force if isinstance(self.force, bool) else str(self.force).lower() in ("1", "true", "yes")
        try:
            with self.ledger_hook(self.postgres_conn_id).get_conn() as conn:
                out = publish(conn, str(self.job_version), actor=_actor(context), force=force,
                              reason=self.reason or None, dataset=self.dataset or None)
        except (PublishRefused, UnknownJob) as exc:
            raise AirflowFailException(f"publish refused: {exc}") from None
        if out["changed"]:
            self.log.info("published %s: %s -> %s%s; downstream reads %s", out["dataset"],
                          out["from_version"] or "(nothing)", out["to_version"], " (FORCED)" if out["forced"] else "",
                          out["view"])
        else:
            self.log.info("%s already published for %s; nothing changed", out["to_version"], out["dataset"])
        self._out = out
        _annotate_events(self, context, out)
        return {k: (str(v) if v is not None and not isinstance(v, (str, int, float, bool)) else v)
                for k, v in out.items()}


class RollbackOperator(_SwitchLineage, LedgerTask, BaseOperator):
    """Switch a dataset back to the version the current one replaced (repeat to walk further back).

    :param dataset: the dataset. Templated.
    :param reason: why, for the publish history. Templated.
    :param expected_current: the version to roll back from, e.g. ``"{{ dag_run.conf.expected_current }}"``:
        if another publish moved the pointer since, the task fails without retries and changes
        nothing (``bi.rollback_v2``). Empty: roll back from whatever is published. Templated.
    :param postgres_conn_id: Airflow connection of the ledger database. Templated.
    :param outlets: usually ``[dataset_asset(DATASET)]``: downstream re-runs on the restored version.
    """

    template_fields: Sequence[str] = ("dataset", "reason", "expected_current", "postgres_conn_id")
    ui_color = "#ef94ad"

    def __init__(self, *, dataset: str, reason: str | None = None, expected_current: str | None = None,
                 postgres_conn_id: str = BatchInferenceHook.default_conn_name, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.dataset = dataset
        self.reason = reason
        self.expected_current = expected_current
        self.postgres_conn_id = postgres_conn_id
        self._out: dict[str, Any] | None = None

    def execute(self, context: Context) -> dict[str, Any]:
        from batch_inference.publish import PublishRefused, rollback

        try:
            with self.ledger_hook(self.postgres_conn_id).get_conn() as conn:
                out = rollback(conn, str(self.dataset), actor=_actor(context), reason=self.reason or None,
                               expected_current=self.expected_current or None)
        except PublishRefused as exc:
            raise AirflowFailException(f"rollback refused: {exc}") from None
        self.log.warning("rolled back %s: %s -> %s; downstream reads %s", out["dataset"], out["from_version"],
                         out["to_version"], out.get("view"))
        self._out = out
        _annotate_events(self, context, out)
        return {k: (str(v) if v is not None and not isinstance(v, (str, int, float, bool)) else v)
                for k, v in out.items()}
