"""The autopilot against the real embedded PostgreSQL: the watch's decisions in the ledger, the
local launcher on real worker processes, and the Kubernetes launcher through the hook.

There is no Kubernetes API server here: the pods go to a stand-in ``CoreV1Api`` (the boundary
that cannot run on these machines, as in tests/unit/test_airflow_pods.py) which validates each
pod body against the Kubernetes 1.33 schema in strict mode and keeps the pods the launcher
lists. Everything else is real: the ledger, the desired size, the worker processes and their
leases.
"""

from __future__ import annotations

import tests.fixtures.airflow_env  # noqa: F401  (before anything imports Airflow)

import asyncio
import json
import os
import sys
import time
from datetime import datetime, timedelta, timezone
from types import SimpleNamespace
from typing import Any

import pytest

from batch_inference import autopilot, db
from batch_inference import deadline as watchlib
from batch_inference.autopilot import Decision
from batch_inference.engines.noop import PACED_ENGINE
from batch_inference.fleet import Fleet
from batch_inference.plan import submit
from batch_inference.status import job_counts
from tests.conftest import make_source, make_spec, tickets

UTC = timezone.utc
PILOT = {"enabled": True, "margin_s": 60, "start_s": 30, "cooldown_s": 600, "window_s": 120}


def new_job(conn, n: int, **over: Any) -> str:
    make_source(conn, tickets(n))
    return submit(conn, make_spec(**over)).job_version


def set_desired(conn, job: str, n: int, current: int = 0) -> None:
    """A decision as the autopilot records it (the launchers read only the desired size)."""
    autopilot.record(conn, job, Decision(datetime.now(UTC), current, n, "add" if n > current else "remove",
                                         f"test: {n} workers", None))


# -- the watch --------------------------------------------------------------------------------


def store_rows(conn, job: str, k: int) -> None:
    """Settle one shard of ``k`` rows through the real ledger functions (claim, put, release)."""
    lease = conn.execute("SELECT * FROM bi.claim_shard_v2(%s, 'w', 'batch', 600)", (job,)).fetchone()
    ids = [r["record_id"] for r in conn.execute(
        "SELECT record_id FROM bi.snapshot_rows WHERE job_version = %s AND shard_no = %s ORDER BY record_id "
        "LIMIT %s", (job, lease["shard_no"], k))]
    conn.execute(db.q("put_results"), {"job": job, "shard": lease["shard_no"], "epoch": lease["epoch"],
                                       "owner": "w", "transport": "batch", "engine": "noop", "endpoint": "local",
                                       "ids": ids, "outputs": ['{"category": "bug", "summary": "x"}'] * len(ids),
                                       "categories": ["bug"] * len(ids)})
    conn.execute("SELECT bi.release_shard_v2(%s, %s, %s, 'w')", (job, lease["shard_no"], lease["epoch"]))


def test_the_watch_adds_workers_when_behind_and_records_every_decision(conn, db_url):
    """A fake clock and a fake sleep (which settles rows as two workers would); the database, the
    counts and the ledger writes are real."""
    job = new_job(conn, 400, shard_size=20, autopilot=PILOT,
                  cost={"gpu_hour_spot": 3.5, "min_workers": 1, "max_workers": 12})
    autopilot.observe(conn, job, "test", 2)             # a launcher runs two workers
    t = [datetime.now(UTC)]
    deadline = t[0] + timedelta(seconds=1800 + 600)     # the spec's overhead (1,800 s) + 10 minutes

    async def sleep(s: float) -> None:
        t[0] += timedelta(seconds=60)
        store_rows(conn, job, 20)                                 # 20 rows a minute: 400 rows need 20 minutes

    payload = asyncio.run(watchlib.watch(lambda: watchlib.connect_async(db_url),
                                         watchlib.WatchConfig(job_version=job, deadline=deadline,
                                                              poll_interval_s=60, warned=True),
                                         now=lambda: t[0], sleep=sleep, max_polls=6))
    assert payload["status"] == "wait", payload
    rows = conn.execute(db.q("fleet_decisions"), {"job": job}).fetchall()
    assert len(rows) == 6                               # one per poll
    assert rows[0]["action"] == "hold" and "no throughput" in rows[0]["reason"]
    add = next(r for r in rows if r["action"] == "add")
    assert add["desired"] > add["current"] == 2
    assert add["finish_with"] < add["finish_without"] and add["bill_with"] <= add["bill_without"]
    assert {o["workers"] for o in add["options"]} >= {1, 2, add["desired"]}
    assert all({"finish", "fire", "fallback_rows", "bill", "within_budget"} <= set(o) for o in add["options"])
    size = conn.execute(db.q("fleet_size"), {"job": job}).fetchone()
    assert size["desired"] == rows[-1]["desired"] and size["desired"] >= add["desired"]
    assert payload["autopilot"]["desired"] == size["desired"]
    # The dashboard shows each change on the progress panel's time axis, with its reason.
    from batch_inference.ui.data import progress

    fleet = progress(conn, job)["fleet"]
    assert [f["desired"] for f in fleet] == [r["desired"] for r in rows if r["action"] != "hold"]
    assert fleet[0]["action"] == "add" and fleet[0]["reason"] == add["reason"]


def test_the_budget_page_ends_the_trigger_once_with_the_arithmetic(conn, db_url):
    job = new_job(conn, 400, shard_size=20, autopilot=PILOT,
                  cost={"gpu_hour_spot": 3.5, "min_workers": 1, "max_workers": 12, "budget": 0.5,
                        "on_budget": "page"})
    autopilot.observe(conn, job, "test", 2)
    t = [datetime.now(UTC)]
    deadline = t[0] + timedelta(seconds=1800 + 300)
    cfg = watchlib.WatchConfig(job_version=job, deadline=deadline, poll_interval_s=60, warned=True)

    async def sleep(s: float) -> None:
        t[0] += timedelta(seconds=60)
        store_rows(conn, job, 20)

    payload = asyncio.run(watchlib.watch(lambda: watchlib.connect_async(db_url), cfg, now=lambda: t[0], sleep=sleep,
                                         max_polls=8))
    assert payload["status"] == watchlib.BUDGET, payload
    assert "budget $0.50" in payload["reason"] and "fallback rows" in payload["reason"]
    # Re-armed with paged=True (as the sensor does) the watch goes on without paging again.
    assert payload["watch"]["paged"] is False
    paged = watchlib.config_from_kwargs(**{**payload["watch"], "paged": True})
    quiet = asyncio.run(watchlib.watch(lambda: watchlib.connect_async(db_url), paged, now=lambda: t[0], sleep=sleep,
                                       max_polls=2))
    assert quiet["status"] != watchlib.BUDGET


def test_a_fixed_fleet_stops_at_the_budget_as_the_autopilots_does_and_its_launcher_follows(conn, db_url):
    """The autopilot off, on_budget page: the watch stops the fleet with the controller's own check (the GPU
    time spent and the fleet's drain against the budget) and records the desired size 0; a fixed fleet's
    launcher follows that size alone (before it, it keeps what it runs). Before, nothing stopped a fixed fleet."""
    job = new_job(conn, 40, cost={"gpu_hour_spot": 3.6, "budget": 0.1, "on_budget": "page"})
    scaled: list[int] = []
    running = lambda: 0 if scaled else 2    # noqa: E731
    assert autopilot.reconcile(conn, job, "local", running, scaled.append, 2, (1, 4), follow=False) == 2
    assert scaled == [] and autopilot.desired_size(conn, job) is None
    cfg = watchlib.WatchConfig(job_version=job, deadline=datetime.now(UTC) + timedelta(hours=2), warned=True)
    payload = asyncio.run(watchlib.watch(lambda: watchlib.connect_async(db_url), cfg, max_polls=1))
    # 2 workers' drain of 60 + 5 s at $3.60 an hour is $0.13, over $0.10 before anything is spent.
    assert payload["status"] == watchlib.BUDGET and payload["reason"].startswith(
        "no fleet size keeps within the budget; the fleet stops: spent $0.00 + 2 worker(s)' drain of 65s is over "
        "the budget $0.10"), payload
    assert autopilot.desired_size(conn, job) == 0
    assert autopilot.reconcile(conn, job, "local", running, scaled.append, 2, (1, 4), follow=False) == 0
    assert scaled == [0]


# -- the local launcher: real worker processes --------------------------------------------------


def worker_fleet(db_url: str, job: str, size: int, tag: str, delay_s: float = 0.2) -> Fleet:
    argv = lambda name: [job, "--engine", PACED_ENGINE, "--engine-option",  # noqa: E731
                         f"delay_s={delay_s}", "--worker-id", name, "--flush-every", "5", "--grace-seconds", "1"]
    env = {**os.environ, "BATCH_INFERENCE_DB": db_url, "PYTHONPATH": os.pathsep.join(sys.path)}
    return Fleet(argv, env, size, name=lambda slot, gen: f"{tag}-w{slot}-g{gen}", echo=False, new_session=True)


def leases(conn, job: str) -> dict[str, int]:
    rows = conn.execute("SELECT lease_owner, shard_no FROM bi.shards WHERE job_version = %s AND state = 'leased'",
                        (job,)).fetchall()
    return {r["lease_owner"]: r["shard_no"] for r in rows}


def wait_for(what, timeout: float = 60.0, every: float = 0.1):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = what()
        if got:
            return got
        time.sleep(every)
    raise AssertionError("timed out")


def test_the_local_launcher_reconciles_to_the_ledger_and_a_removed_worker_releases_its_lease(conn, db_url):
    job = new_job(conn, 300, shard_size=10, lease_seconds=120, renew_seconds=5,
                  cost={"gpu_hour_spot": 3.5, "min_workers": 1, "max_workers": 4})
    fleet = worker_fleet(db_url, job, 1, "a")
    try:
        fleet.start_all()
        running = lambda: len(fleet.slots())  # noqa: E731
        # No decision yet: the launcher keeps its default.
        assert autopilot.reconcile(conn, job, "local", running, fleet.scale_to, 1, (1, 4)) == 1
        set_desired(conn, job, 3, 1)
        assert autopilot.reconcile(conn, job, "local", running, fleet.scale_to, 1, (1, 4)) == 3
        assert running() == 3
        wait_for(lambda: len(leases(conn, job)) == 3)
        held = leases(conn, job)
        # Down to one: the two newest get SIGTERM and give their shards back at once, far inside the
        # 120 s lease (no expiry involved).
        set_desired(conn, job, 1, 3)
        t0 = time.monotonic()
        assert autopilot.reconcile(conn, job, "local", running, fleet.scale_to, 1, (1, 4)) == 1
        removed = {w.name for w in fleet.workers if w is not None and w.slot in (1, 2)}
        wait_for(lambda: not (removed & set(leases(conn, job))), timeout=20)
        assert time.monotonic() - t0 < 20 and removed & set(held)
        wait_for(lambda: (fleet.poll(), len(fleet.exits) >= 2)[1], timeout=20)
        assert all(e.preempted for e in fleet.exits) and running() == 1
        # The ledger's bounds win over a desired size outside them.
        set_desired(conn, job, 9, 1)
        assert autopilot.reconcile(conn, job, "local", running, fleet.scale_to, 1, (1, 4)) == 4
        set_desired(conn, job, 2, 4)
        autopilot.reconcile(conn, job, "local", running, fleet.scale_to, 1, (1, 4))
    finally:
        fleet.stop(5.0)
    autopilot.observe(conn, job, "local", 0)
    # A restarted launcher resumes from the ledger (2), not from its default (1). Its workers answer
    # ten times faster: what is left of the job is only to be finished.
    again = worker_fleet(db_url, job, 1, "b", delay_s=0.02)
    try:
        again.start_all()
        assert autopilot.reconcile(conn, job, "local", lambda: len(again.slots()), again.scale_to, 1, (1, 4)) == 2
        assert len(again.slots()) == 2
        wait_for(lambda: job_counts(conn, job)["outstanding"] == 0, timeout=120)
    finally:
        again.stop(5.0)
    autopilot.observe(conn, job, "local", 0)
    cov = conn.execute(db.q("chaos_coverage"), {"job": job}).fetchone()
    assert cov["duplicates"] == 0 and cov["missing"] == 0
    observed = [r["running"] for r in conn.execute(
        "SELECT running FROM bi.fleet_observed WHERE job_version = %s ORDER BY id", (job,))]
    assert observed[:3] == [1, 3, 1] and observed[-1] == 0
    assert autopilot.gpu_hours(conn, job) > 0


# -- the Kubernetes launcher: pods through the hook -----------------------------------------------


class FakeCoreV1Api:
    """The boundary: the pods API, as ``kubernetes.client.CoreV1Api`` answers it. Each created body
    is validated against the Kubernetes 1.33 schema (strict: unknown fields fail); a deletion marks
    the pod terminating, as the API server does while the kubelet's SIGTERM grace runs."""

    def __init__(self) -> None:
        self.pods: dict[str, dict[str, Any]] = {}
        self.calls: list[tuple[str, str, Any]] = []
        self.lists = 0

    def create_namespaced_pod(self, namespace: str, body: dict[str, Any], **kw: Any) -> Any:
        import kubernetes_validate

        kubernetes_validate.validate(body, "1.33", strict=True)
        name = body["metadata"]["name"]
        assert name not in self.pods, f"409 Conflict: pod {name} exists"
        self.pods[name] = json.loads(json.dumps(body))
        self.calls.append(("create", name, body))
        return self._pod(name)

    def delete_namespaced_pod(self, name: str, namespace: str, grace_period_seconds: int | None = None, **kw: Any):
        self.pods[name]["metadata"]["deletionTimestamp"] = datetime.now(UTC).isoformat()
        self.calls.append(("delete", name, grace_period_seconds))

    def list_namespaced_pod(self, namespace: str, label_selector: str = "", **kw: Any) -> Any:
        self.lists += 1
        want = dict(kv.split("=", 1) for kv in label_selector.split(",") if kv)
        items = [self._pod(n) for n, p in self.pods.items()
                 if all(p["metadata"].get("labels", {}).get(k) == v for k, v in want.items())]
        return SimpleNamespace(items=items)

    def _pod(self, name: str) -> Any:
        from kubernetes.client import ApiClient

        return ApiClient()._ApiClient__deserialize(self.pods[name], "V1Pod")

    def end(self, name: str, phase: str, exit_code: int | None = None, reason: str | None = None) -> None:
        """The pod ends as the kubelet reports it: the phase, the container's exit code, the pod's reason."""
        status: dict[str, Any] = {"phase": phase}
        if reason:
            status["reason"] = reason
        if exit_code is not None:
            status["containerStatuses"] = [{
                "name": "base", "image": "batch-inference-gpu:0.1.0", "imageID": "", "ready": False,
                "restartCount": 0, "state": {"terminated": {"exitCode": exit_code, "reason": "Error"}}}]
        self.pods[name]["status"] = status

    def read_namespaced_pod_log(self, name: str, namespace: str, container: str | None = None,
                                tail_lines: int | None = None, **kw: Any) -> str:
        self.calls.append(("log", name, container))
        return f"{name}: the last lines of its log"


def test_gpu_pods_are_added_and_removed_through_the_hook(conn, db_url, monkeypatch):
    pytest.importorskip("kubernetes_validate")
    from airflow.sdk import DAG

    from batch_inference.operators.gpu_autopilot import GpuAutopilotOperator, pod_name

    job = new_job(conn, 100, cost={"min_workers": 1, "max_workers": 6})
    api = FakeCoreV1Api()
    hook = SimpleNamespace(core_v1_client=api)
    with DAG("gpu_autopilot_test", schedule=None):
        op = GpuAutopilotOperator(task_id="gpu_autopilot", job_version=job, workers=2,
                                  pod_kwargs={"kueue_queue": "gpu-batch", "grace_seconds": 90,
                                              "grace_margin_seconds": 15, "gpus": 1})
    monkeypatch.setattr(op, "hook", lambda: hook)
    launcher = op.launcher(job)
    size = autopilot.reconcile(conn, job, "k8s", launcher.running, launcher.scale, 2, (1, 6))
    assert size == 2 and sorted(api.pods) == [pod_name(job, 0), pod_name(job, 1)]
    set_desired(conn, job, 5, 2)
    assert autopilot.reconcile(conn, job, "k8s", launcher.running, launcher.scale, 2, (1, 6)) == 5
    body = api.pods[pod_name(job, 4)]
    # The same pod as GpuWorkerPodOperator's: GPU limit, priority class, queue, the worker Secret.
    (c,) = body["spec"]["containers"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "1" and body["spec"]["priorityClassName"] == "batch-low"
    assert body["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "gpu-batch"
    assert body["metadata"]["labels"]["batch-inference/worker-slot"] == "4"
    assert body["metadata"]["labels"]["batch-inference/autopilot"] == "true"
    assert c["args"][:2] == ["worker", job]
    # Down to two: the newest slots are deleted with the pod's termination grace (SIGTERM, then 105 s).
    set_desired(conn, job, 2, 5)
    autopilot.reconcile(conn, job, "k8s", launcher.running, launcher.scale, 2, (1, 6))
    deletes = [(n, g) for kind, n, g in api.calls if kind == "delete"]
    assert deletes == [(pod_name(job, 4), 105), (pod_name(job, 3), 105), (pod_name(job, 2), 105)]
    assert launcher.running() == 2
    # A restarted launcher lists its pods and resumes: nothing created, nothing deleted.
    before = len(api.calls)
    again = op.launcher(job)
    assert autopilot.reconcile(conn, job, "k8s", again.running, again.scale, 1, (1, 6)) == 2
    assert len(api.calls) == before
    # Up again: a new slot, never the name of a pod that still exists (terminating or ended).
    for s in (2, 3, 4):
        api.end(pod_name(job, s), "Failed")
    set_desired(conn, job, 3, 2)
    autopilot.reconcile(conn, job, "k8s", again.running, again.scale, 2, (1, 6))
    assert again.running() == 3 and pod_name(job, 5) in api.pods
    # A worker that found nothing left to claim exited 0: no pod is added after that.
    api.end(pod_name(job, 0), "Succeeded")
    set_desired(conn, job, 6, 3)
    autopilot.reconcile(conn, job, "k8s", again.running, again.scale, 2, (1, 6))
    assert again.running() == 2
    observed = [r["running"] for r in conn.execute(
        "SELECT running FROM bi.fleet_observed WHERE job_version = %s ORDER BY id", (job,))]
    assert observed == [2, 5, 2, 3, 2]


def test_the_sensor_sends_the_budget_page_to_its_notifiers_and_watches_on(db_url, monkeypatch):
    from airflow.sdk.exceptions import TaskDeferred

    from batch_inference.db import airflow_connection_json
    from batch_inference.sensors.cutoff import CutoffSensor

    monkeypatch.setenv("AIRFLOW_CONN_BATCH_INFERENCE_DEFAULT", airflow_connection_json(db_url))
    got: list[dict] = []
    s = CutoffSensor(task_id="cutoff", job_version="jv_x", deadline="06:00",
                     on_early_warning=lambda context, event: got.append(event))
    watch = watchlib.watch_kwargs(watchlib.WatchConfig(job_version="jv_x",
                                                       deadline=datetime(2026, 3, 5, 6, 0, tzinfo=UTC)))
    page = "the deadline would cost more than the budget; keeping within it with 2 worker(s): ..."
    with pytest.raises(TaskDeferred) as exc:
        s.execute_complete({}, {"status": watchlib.BUDGET, "reason": page, "watch": watch})
    assert got and got[0]["warning"]["message"] == page
    kwargs = exc.value.trigger.serialize()[1]
    assert kwargs["paged"] is True and kwargs["warned"] is False


def test_the_gpu_launcher_replaces_preempted_pods_and_fails_on_a_halting_exit_or_too_many_crashes(conn, monkeypatch):
    pytest.importorskip("kubernetes_validate")
    from airflow.sdk import DAG
    from airflow.sdk.exceptions import AirflowFailException

    from batch_inference.operators.gpu_autopilot import GpuAutopilotOperator, pod_name

    job = new_job(conn, 40, cost={"min_workers": 1, "max_workers": 4})
    api = FakeCoreV1Api()
    with DAG("gpu_failures_test", schedule=None):
        op = GpuAutopilotOperator(task_id="gpu_autopilot", job_version=job, workers=2, max_pod_failures=2,
                                  pod_kwargs={"grace_seconds": 90, "grace_margin_seconds": 15})
    monkeypatch.setattr(op, "hook", lambda: SimpleNamespace(core_v1_client=api))
    launcher = op.launcher(job)

    def reconcile() -> None:
        op.check_failures(launcher)
        autopilot.reconcile(conn, job, "k8s", launcher.running, launcher.scale, 2, (1, 4))

    reconcile()
    # Preempted (the worker's SIGTERM exit, or the node shut down under it): replaced, never counted.
    api.end(pod_name(job, 0), "Failed", exit_code=143)
    api.end(pod_name(job, 1), "Failed", reason="Shutdown")
    reconcile()
    assert launcher.running() == 2 and {pod_name(job, 2), pod_name(job, 3)} <= set(api.pods)
    assert [f.preempted for f in launcher.failures()] == [True, True]
    # Crashes are replaced up to max_pod_failures, each one's log read once into the task log.
    api.end(pod_name(job, 2), "Failed", exit_code=5)
    api.end(pod_name(job, 3), "Failed", exit_code=1)
    reconcile()
    assert launcher.running() == 2
    assert sorted(n for kind, n, _ in api.calls if kind == "log") == [pod_name(job, s) for s in range(4)]
    api.end(pod_name(job, 4), "Failed", exit_code=2)
    with pytest.raises(AirflowFailException, match=r"3 worker pods failed \(more than max_pod_failures=2\)"):
        op.check_failures(launcher)
    # A halting exit (the weights do not match the digest) fails at once: no pod is started again.
    job2 = new_job(conn, 40, dataset="tickets_halting", cost={"min_workers": 1, "max_workers": 4})
    api2 = FakeCoreV1Api()
    monkeypatch.setattr(op, "hook", lambda: SimpleNamespace(core_v1_client=api2))
    l2 = op.launcher(job2)
    autopilot.reconcile(conn, job2, "k8s", l2.running, l2.scale, 1, (1, 4))
    api2.end(pod_name(job2, 0), "Failed", exit_code=3)
    with pytest.raises(AirflowFailException, match="exit 3: the model weights do not match the digest"):
        op.check_failures(l2)


def test_a_reconcile_pass_lists_the_pods_once_and_again_only_after_adding_or_removing_one(conn, monkeypatch):
    pytest.importorskip("kubernetes_validate")
    from airflow.sdk import DAG

    from batch_inference.operators.gpu_autopilot import GpuAutopilotOperator, pod_name

    job = new_job(conn, 40, dataset="tickets_one_pass", cost={"min_workers": 1, "max_workers": 4})
    api = FakeCoreV1Api()
    with DAG("gpu_one_pass_test", schedule=None):
        op = GpuAutopilotOperator(task_id="gpu_autopilot", job_version=job, workers=2,
                                  pod_kwargs={"grace_seconds": 90, "grace_margin_seconds": 15})
    monkeypatch.setattr(op, "hook", lambda: SimpleNamespace(core_v1_client=api))
    launcher = op.launcher(job)

    def one_pass() -> int:
        """A pass as the operator runs it; returns how many times it listed the pods."""
        before = api.lists
        with launcher.one_pass():
            op.check_failures(launcher)
            autopilot.reconcile(conn, job, "k8s", launcher.running, launcher.scale, 2, (1, 4))
        return api.lists - before

    assert one_pass() == 2 and launcher.running() == 2       # none -> two: listed, then again after adding
    assert one_pass() == 1                                   # nothing to change
    api.end(pod_name(job, 0), "Failed", exit_code=143)       # preempted: replaced in the next pass
    assert one_pass() == 2 and pod_name(job, 2) in api.pods
    set_desired(conn, job, 1, 2)
    assert one_pass() == 2 and launcher.running() == 1       # removed: listed again to record what runs
    # Outside a pass nothing is kept: a pod ended since is seen at once.
    api.end(pod_name(job, 1), "Failed", exit_code=143)
    assert launcher.running() == 0


# -- issue 39: hosted jobs, the drain, the budget ------------------------------------------------


def test_a_hosted_batch_job_gets_no_gpu_workers_no_decisions_and_no_gpu_hours(conn, db_url, monkeypatch):
    """Before: the watch steered a hosted batch job's fleet (adds included) and the bill priced its
    workers' time as GPU-hours, though they only hand the records to the provider."""
    from airflow.sdk import DAG
    from airflow.sdk.exceptions import AirflowFailException

    from batch_inference.operators.gpu_autopilot import GpuAutopilotOperator
    from batch_inference.status import bill

    job = new_job(conn, 400, shard_size=20, autopilot=PILOT, cleared_for_hosted=True,
                  engine={"name": "openai-batch", "options": {"base_url": "http://127.0.0.1:9/v1",
                                                              "api_key_env": "BI_TEST_OPENAI_KEY"}},
                  cost={"gpu_hour_spot": 3.5, "min_workers": 1, "max_workers": 12})
    autopilot.observe(conn, job, "test", 2)             # a launcher runs two (hosted batch) workers
    t = [datetime.now(UTC)]

    async def sleep(s: float) -> None:
        t[0] += timedelta(seconds=60)
        store_rows(conn, job, 20)

    payload = asyncio.run(watchlib.watch(lambda: watchlib.connect_async(db_url),
                                         watchlib.WatchConfig(job_version=job, deadline=t[0] + timedelta(seconds=2400),
                                                              poll_interval_s=60, warned=True),
                                         now=lambda: t[0], sleep=sleep, max_polls=6))
    assert payload["status"] == "wait" and payload["autopilot"] is None
    assert conn.execute(db.q("fleet_decisions"), {"job": job}).fetchall() == []
    time.sleep(0.05)
    so_far, _ = bill(conn, job)
    assert (float(so_far.gpu_hours), float(so_far.gpu_cost)) == (0.0, 0.0)
    assert autopilot.gpu_hours(conn, job) == 0.0
    # The Kubernetes launcher starts no GPU pod for it: one line, before anything is created.
    api = FakeCoreV1Api()
    monkeypatch.setenv("AIRFLOW_CONN_BATCH_INFERENCE_DEFAULT", db.airflow_connection_json(db_url))
    with DAG("gpu_hosted_test", schedule=None):
        op = GpuAutopilotOperator(task_id="gpu_autopilot", job_version=job, workers=2,
                                  pod_kwargs={"grace_seconds": 90, "grace_margin_seconds": 15, "grant_role": None})
    monkeypatch.setattr(op, "hook", lambda: SimpleNamespace(core_v1_client=api))
    with pytest.raises(AirflowFailException, match="hosted batch transport: its records go to the provider, so no "
                                                   "GPU worker is started"):
        op.execute({})
    assert api.calls == []


def test_gpu_pods_still_running_when_the_drain_is_over_are_deleted_at_once(conn, db_url, monkeypatch):
    """In fallback mode the pods drain; one still running ``autopilot.drain_s`` after the cutoff (its
    lease is gone) is deleted with no grace, so the GPU time the budget reserved is the most it costs."""
    pytest.importorskip("kubernetes_validate")
    from airflow.sdk import DAG

    from batch_inference.fallback import enter_fallback
    from batch_inference.operators.gpu_autopilot import GpuAutopilotOperator, pod_name

    job = new_job(conn, 40, dataset="tickets_drain", lease_seconds=2, renew_seconds=0.5,
                  cost={"min_workers": 1, "max_workers": 4})
    api = FakeCoreV1Api()
    monkeypatch.setenv("AIRFLOW_CONN_BATCH_INFERENCE_DEFAULT", db.airflow_connection_json(db_url))
    with DAG("gpu_drain_test", schedule=None):
        op = GpuAutopilotOperator(task_id="gpu_autopilot", job_version=job, workers=2, reconcile_seconds=0.1,
                                  drain_timeout_s=30, pod_kwargs={"grace_seconds": 90, "grace_margin_seconds": 15, "grant_role": None})
    monkeypatch.setattr(op, "hook", lambda: SimpleNamespace(core_v1_client=api))
    launcher = op.launcher(job)
    autopilot.reconcile(conn, job, "k8s:batch-inference", launcher.running, launcher.scale, 2, (1, 4))
    assert launcher.running() == 2
    assert enter_fallback(conn, job)
    t0 = time.monotonic()
    out = op.execute({})
    took = time.monotonic() - t0
    assert out["mode"] == "fallback" and launcher.running() == 0
    deletes = [(n, g) for kind, n, g in api.calls if kind == "delete"]
    assert sorted(deletes) == [(pod_name(job, 0), 0), (pod_name(job, 1), 0)]
    assert 1.5 <= took < 30, took                         # drain_s = 2.5 s after the cutoff, not the drain timeout
    observed = [r["running"] for r in conn.execute(
        "SELECT running FROM bi.fleet_observed WHERE job_version = %s ORDER BY id", (job,))]
    assert observed[0] == 2 and observed[-1] == 0
