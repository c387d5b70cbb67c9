"""The standard batch-inference graph, added to the DAG being defined.

Every example DAG runs the same tasks::

    estimate ── submit ──┬── <workers> ───────────────────────────────┬── validate ── review ── publish ──> Asset batch_inference.<dataset>
                         └── deadline ── cutoff (sensor) ── fallback ─┘

What differs from one DAG to the next is the schedule, the Params'
defaults, the deadline and how the workers run, so those stay in the DAG
file and this module builds the rest:

* :func:`batch_inference_pipeline` adds the nine tasks (the workers come
  from a launcher the DAG passes in) and wires them; ``estimate``, the
  preview before any spend, stops a night already over ``cost.budget`` or
  past its deadline before submit (``estimate=False`` leaves it out);
* :func:`local_workers` is the launcher for worker processes on the Airflow
  worker (a DAG with pods writes its own: see ``batch_inference_gpu``);
  :func:`region_workers`, the same per cluster of a version placed over
  regions (with ``deployment=``, a ``merge`` task beside them merges the far
  workers' result files before validate: ``batch_inference_regions``);
* :func:`pipeline_params` is the trigger form every such DAG offers;
* :func:`pipeline_dag_args` is the rest of ``DAG(...)`` they share: one run at
  a time, no catch-up, retries and the on-call notifier on every task.

The task ids are fixed (``estimate``, ``submit``, ``deadline``, ``cutoff``, ``fallback``,
``validate``, ``review``, ``publish``), so the callbacks, the dashboard's DAG-run tab and
on-call messages find the job version the same way in every DAG.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from airflow.sdk import Param, task

from batch_inference.callbacks import OnCallNotifier
from batch_inference.data import DEMO_SPEC
from batch_inference.hooks.connection import DEFAULT_CONN_ID
from batch_inference.operators.fallback import FallbackPoolOperator
from batch_inference.operators.publish import PublishOperator, dataset_asset
from batch_inference.operators.review import ReviewGateOperator
from batch_inference.operators.submit import SubmitJobOperator
from batch_inference.operators.validate import ValidateOperator
from batch_inference.sensors.cutoff import CutoffSensor

# The engines the trigger form offers beside the spec's own: noop is left out, since workers run it
# only under a spec whose engine is noop (batch_inference.provenance), where the empty choice gives it.
ENGINES = ("llama-cpp", "openai", "vllm", "openai-batch", "anthropic-batch", "bedrock-batch", "gemini-batch")

# A launcher gets the job version (an XComArg of submit) and the ledger's
# connection id, and adds the worker task(s): it returns one task, or
# (first, last) when the workers are several tasks in a row (a slot-count
# task, then the pods mapped over it).
WorkerLauncher = Callable[[Any, str], Any]

# The wait before a retry of the tasks that defer (submit, cutoff, review; the DAG's other tasks wait a
# minute): a try lost to the race of a trigger that fires within seconds of the deferral (apache/airflow#72716,
# docs/airflow.md) costs the run 10 s, not a minute, and the next try decides at once (the cutoff's first poll,
# the version already submitted, a rejection standing in the ledger).
DEFERRING_RETRY_DELAY = timedelta(seconds=10)


@dataclass(frozen=True)
class Pipeline:
    """The tasks :func:`batch_inference_pipeline` added, for further wiring."""

    submit: Any
    job_version: Any            # submit.output["job_version"]
    workers: Any                # the launcher's last task
    deadline: Any
    cutoff: Any
    fallback: Any
    validate: Any
    review: Any
    publish: Any
    estimate: Any = None        # the preview before submit (None: left out)
    merge: Any = None           # the far workers' result files merged (None: one region)


@task(task_id="deadline")
def resolve_deadline(deadline: str, run_after: str, run_type: str = "") -> str:
    """'+20h' becomes an ISO time after the run's start (a backfill run's: now); 'HH:MM' and ISO pass
    to the sensor as they are."""
    from batch_inference.params import deadline_reference, resolve_deadline as resolve

    return resolve(deadline, deadline_reference(datetime.fromisoformat(run_after), run_type))


def default_cutoff_poll() -> float:
    """Seconds between the cutoff trigger's reads of the counts where a DAG names none: the deployment's
    ``[batch_inference] cutoff_poll_interval`` (``AIRFLOW__BATCH_INFERENCE__CUTOFF_POLL_INTERVAL``), read
    when the DAG is parsed, 60 when unset."""
    from airflow.sdk.configuration import conf

    return conf.getfloat("batch_inference", "cutoff_poll_interval", fallback=60.0)


def default_review_poll() -> float:
    """Seconds between the review trigger's reads of the review gate where a DAG names no interval: the
    deployment's ``[batch_inference] review_poll_interval`` (``AIRFLOW__BATCH_INFERENCE__REVIEW_POLL_INTERVAL``),
    read when the DAG is parsed, 15 when unset."""
    from airflow.sdk.configuration import conf

    return conf.getfloat("batch_inference", "review_poll_interval", fallback=15.0)


def batch_inference_pipeline(*, dataset: str, workers: WorkerLauncher, spec: str = "{{ params.spec_path }}",
                             incremental: bool | str | None = None, cutoff_poll_interval: float | None = None,
                             review_poll_interval: float | None = None, postgres_conn_id: str = DEFAULT_CONN_ID,
                             fallback_kwargs: dict[str, Any] | None = None,
                             page_reserve_s: float | None = None, estimate: bool = True,
                             deployment: str | None = None) -> Pipeline:
    """Add estimate → submit → workers / deadline → cutoff → fallback → validate → review → publish to the
    current DAG.

    Call it inside ``with DAG(...)``. The DAG's Params must include those of
    :func:`pipeline_params` (``source_table``, ``shard_size``, ``deadline``,
    ``review_timeout``; the launcher usually reads ``workers`` and ``engine``).

    :param dataset: the published dataset; ``publish`` records an event on ``dataset_asset(dataset)``.
    :param workers: ``launcher(job_version, postgres_conn_id)`` adds the worker task(s) and returns one task, or
        ``(first, last)``: ``first`` runs after submit, ``validate`` waits for ``last``.
    :param spec: the job spec (templated; a path relative to the DAG file, or a dict).
    :param incremental: overrides the spec's ``incremental`` (e.g. ``"{{ params.incremental }}"``);
        None keeps the spec's.
    :param cutoff_poll_interval: seconds between the cutoff trigger's reads of the counts; None: the
        deployment's ``[batch_inference] cutoff_poll_interval`` (``default_cutoff_poll``), 60 when unset.
    :param review_poll_interval: seconds between the review trigger's reads of the review gate; None: the
        deployment's ``[batch_inference] review_poll_interval`` (``default_review_poll``), 15 when unset.
    :param postgres_conn_id: the ledger's Airflow connection, for every task.
    :param fallback_kwargs: more arguments of the ``FallbackPoolOperator`` (``api_key_env``, ``base_url``...).
    :param page_reserve_s: what the publish needs after the re-drive, the margin by which the cutoff and the
        fallback know the deadline is lost and page on-call early (default
        ``cutoff.PAGE_RESERVE_SHARE`` of the spec's ``fallback.overhead_s``).
    :param estimate: add the preview task before submit (``EstimateOperator``: the run stops there, paged,
        when the preview is over ``cost.budget`` or cannot meet the deadline).
    :param deployment: clusters in several regions (a deployment YAML, templated, e.g.
        ``"{{ params.deployment }}"``; docs/regions.md): submit checks every store and connection and
        replicates the snapshot near each cluster, and a ``merge`` task beside the workers merges the far
        workers' result files by key before validate (``RegionMergeOperator``; the launcher is
        :func:`region_workers`). None: one region, no merge task.
    """
    submit = SubmitJobOperator(
        task_id="submit",
        spec=spec,
        source_table="{{ params.source_table }}",
        shard_size="{{ params.shard_size }}",
        incremental=incremental,
        postgres_conn_id=postgres_conn_id,
        retry_delay=DEFERRING_RETRY_DELAY,
        **({"deployment": deployment} if deployment is not None else {}),
    )
    preview = None
    if estimate:
        from batch_inference.operators.estimate import EstimateOperator

        preview = EstimateOperator(task_id="estimate", spec=spec, source_table="{{ params.source_table }}",
                                   shard_size="{{ params.shard_size }}", incremental=incremental,
                                   postgres_conn_id=postgres_conn_id, deadline="{{ params.deadline }}",
                                   workers="{{ params.workers }}", run_after="{{ dag_run.run_after.isoformat() }}",
                                   run_type="{{ dag_run.run_type }}")
        preview >> submit
    job_version = submit.output["job_version"]
    launched = workers(job_version, postgres_conn_id)
    first, last = launched if isinstance(launched, tuple) else (launched, launched)

    deadline = resolve_deadline("{{ params.deadline }}", "{{ dag_run.run_after.isoformat() }}", "{{ dag_run.run_type }}")
    poll = default_cutoff_poll() if cutoff_poll_interval is None else cutoff_poll_interval
    cutoff = CutoffSensor(task_id="cutoff", job_version=job_version, deadline=deadline,
                          poll_interval=poll, postgres_conn_id=postgres_conn_id,
                          page_reserve_s=page_reserve_s, retry_delay=DEFERRING_RETRY_DELAY)
    # The sensor's resolved deadline: with it a failing endpoint pages early and is re-driven in the try.
    resolved = f"{{{{ (ti.xcom_pull(task_ids='{cutoff.task_id}') or {{}}).get('deadline') }}}}"
    fallback = FallbackPoolOperator(task_id="fallback", job_version=job_version, postgres_conn_id=postgres_conn_id,
                                    deadline=resolved, page_reserve_s=page_reserve_s,
                                    **(fallback_kwargs or {}))
    validate = ValidateOperator(task_id="validate", job_version=job_version, postgres_conn_id=postgres_conn_id)
    # Holds publish while the spec's human review gate is open (a Required Action in Airflow's UI).
    review = ReviewGateOperator(task_id="review", job_version=job_version, timeout="{{ params.review_timeout }}",
                                retry_delay=DEFERRING_RETRY_DELAY,
                                poll_interval=default_review_poll() if review_poll_interval is None
                                else review_poll_interval, postgres_conn_id=postgres_conn_id)
    publish = PublishOperator(task_id="publish", job_version=job_version, postgres_conn_id=postgres_conn_id,
                              outlets=[dataset_asset(dataset)])

    # The cutoff watches beside the workers, not after them; validate waits for both paths.
    submit >> [first, deadline]
    deadline >> cutoff >> fallback
    [last, fallback] >> validate >> review >> publish
    merge = None
    if deployment is not None:
        # Beside the workers too: a far worker's shard is done when its file is merged, not at its hand-in.
        from batch_inference.operators.regions import RegionMergeOperator

        merge = RegionMergeOperator(task_id="merge", job_version=job_version, postgres_conn_id=postgres_conn_id)
        submit >> merge >> validate
    return Pipeline(submit, job_version, last, deadline, cutoff, fallback, validate, review, publish, preview, merge)


def local_workers(*, workers: Any = "{{ params.workers }}", engine: Any = "{{ params.engine }}",
                  **kwargs: Any) -> WorkerLauncher:
    """A launcher for ``LocalWorkersOperator`` (task id ``workers``): N ``python -m gpu_runner``
    processes on the Airflow worker. ``kwargs`` go to the operator (``max_restarts``, ``env``...)."""
    from batch_inference.operators.local_workers import LocalWorkersOperator

    def launch(job_version: Any, postgres_conn_id: str) -> Any:
        return LocalWorkersOperator(task_id="workers", job_version=job_version, workers=workers, engine=engine,
                                    postgres_conn_id=postgres_conn_id, **kwargs)

    return launch


def region_workers(*, workers: Any = "{{ params.workers }}", engine: Any = "{{ params.engine }}",
                   **kwargs: Any) -> WorkerLauncher:
    """A launcher for a version placed over regions: a ``regions`` task reads the placed clusters whose
    workers are local, and ``LocalWorkersOperator`` (task id ``workers``) is mapped over them, each
    cluster's processes with ``--region`` (and ``--result-files`` outside the ledger's region), at most
    its capacity. A version never placed runs one set of plain workers. ``kwargs`` go to the operator."""
    from batch_inference.operators.local_workers import LocalWorkersOperator

    def launch(job_version: Any, postgres_conn_id: str) -> Any:
        @task(task_id="regions")
        def regions(job: str, n: Any) -> list[dict[str, Any]]:
            from batch_inference.operators.regions import region_slots

            return region_slots(postgres_conn_id, job, int(n))

        slots = regions(job_version, workers)
        mapped = LocalWorkersOperator.partial(task_id="workers", job_version=job_version, engine=engine,
                                              postgres_conn_id=postgres_conn_id, **kwargs).expand_kwargs(slots)
        return slots, mapped

    return launch


def pipeline_params(*, spec_path: str | Path = DEMO_SPEC, source_table: str = "", shard_size: int = 25,
                    workers: int = 2, max_workers: int = 64, engine: str = "", deadline: str = "+20h",
                    review_timeout: str = "+12h", workers_title: str = "Workers",
                    workers_description: str = "Local worker processes") -> dict[str, Param]:
    """The trigger form: spec, source table, shard size, workers, engine, deadline and review timeout,
    with these defaults.

    ``spec_path`` defaults to the packaged demo spec: a DAG of your own passes its spec. ``source_table``
    empty (the default) snapshots the spec's own source; a ``schema.table`` replaces it for a run.
    ``engine=""`` means the spec's engine and is offered first; any other default leaves the empty
    choice out (the DAG insists on an engine); ``noop`` is offered only as the default (``ENGINES``).
    Add DAG-specific Params with ``{**pipeline_params(...), "name": Param(...)}``.
    """
    engines = ["", *ENGINES] if engine == "" else [engine, *(e for e in ENGINES if e != engine)]
    return {
        "spec_path": Param(str(spec_path), type="string", title="Job spec",
                           description="Path to the job spec YAML (relative paths: next to this DAG file)"),
        "source_table": Param(source_table, type="string", title="Snapshot source table",
                              description="schema.table to snapshot instead of the spec's source; empty: the "
                                          "spec's own source"),
        "shard_size": Param(shard_size, type="integer", minimum=1, title="Shard size",
                            description="Records per shard (5,000: about 4.5 minutes of work on one GPU; "
                                        "small for the demo)"),
        "workers": Param(workers, type="integer", minimum=1, maximum=max_workers, title=workers_title,
                         description=workers_description),
        "engine": Param(engine, type="string", enum=engines, title="Engine",
                        description=("Empty: the spec's engine. " if engine == "" else "")
                        + "Another engine runs the same pinned model and prompt"),
        "deadline": Param(deadline, type="string", title="Deadline",
                          description="'+20h' / '+90m' after the run starts, 'HH:MM' (next such time, UTC), "
                                      "or an ISO datetime"),
        "review_timeout": Param(review_timeout, type="string", title="Review timeout",
                                description="When a spec's human review gate is still open, page on-call and fail "
                                            "the run: '+12h' / '+90m' after the review opens, 'HH:MM' (next such "
                                            "time, UTC), an ISO datetime, or empty to wait without end"),
    }


def pipeline_dag_args(postgres_conn_id: str = DEFAULT_CONN_ID, *, retries: int = 2,
                      start_date: datetime = datetime(2025, 1, 1), max_active_runs: int | None = None
                      ) -> dict[str, Any]:
    """``DAG(**pipeline_dag_args())``: no catch-up, and on every task ``retries`` for transient failures
    (configuration errors fail at once) and the on-call page (``OnCallNotifier``). Runs of different
    datasets go on side by side, up to ``max_active_runs`` at once (None: the deployment's ``[core]
    max_active_runs_per_dag``, 16 by default); a run on a dataset that an earlier run (of any DAG) still
    works waits in its submit for that run to end, so one dataset's versions are worked and published in
    the order they were submitted (``SubmitJobOperator``)."""
    return {
        "start_date": start_date,
        "catchup": False,
        **({} if max_active_runs is None else {"max_active_runs": max_active_runs}),
        "default_args": {
            "retries": retries,
            "retry_delay": timedelta(minutes=1),
            "on_failure_callback": OnCallNotifier(postgres_conn_id=postgres_conn_id),
        },
    }
