"""The dashboard: a FastAPI app that ``airflow api-server`` mounts at /batch-inference.

Pages are static shells (HTML, one script, one stylesheet, all served from
this package: no CDN, no web fonts, so the page works on an air-gapped
cluster); every number on them comes from a JSON endpoint under ``/api``,
so what the page shows and what a script can fetch are the same thing.

Airflow does not authenticate plugin routes, so this app does it itself with
Airflow's own dependencies: every ``/api`` route requires an authenticated
Airflow user (a Bearer token or the UI's ``_token`` cookie), and the one
write, rollback, additionally requires the auth manager to allow that user to
trigger the dataset's DAG (``is_authorized_dag(method="POST", access_entity=RUN)``),
the same check Airflow applies to ``POST /api/v2/dags/{dag_id}/dagRuns``.
Rollback is POST-only with a JSON body and a same-origin check, so a page on
another site cannot forge it with the user's cookie.

The ledger database is found, in order, from ``$BATCH_INFERENCE_DB`` or the
Airflow connection named by ``$BATCH_INFERENCE_CONN_ID`` (default
``batch_inference_default``).
"""

from __future__ import annotations

import html
import json
import logging
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import urlencode, urlparse

import psycopg
from fastapi import APIRouter, Body, Depends, FastAPI, HTTPException, Query, Request, status
from fastapi.responses import FileResponse, HTMLResponse, RedirectResponse, Response
from fastapi.security import HTTPAuthorizationCredentials
from airflow.api_fastapi.auth.managers.models.base_user import BaseUser
from airflow.api_fastapi.auth.managers.models.resource_details import DagAccessEntity, DagDetails
from airflow.api_fastapi.core_api.security import (
    GetUserDep,
    bearer_scheme,
    get_user,
    requires_access_dag,
    requires_authenticated,
)

from batch_inference import db
from batch_inference.status import UnknownJob
from batch_inference.ui import actions, data

log = logging.getLogger(__name__)

CONN_ID_ENV = "BATCH_INFERENCE_CONN_ID"
DEFAULT_CONN_ID = "batch_inference_default"
# Which DAG's "trigger" permission a rollback of a dataset needs: one DAG id
# for every dataset, or a JSON object {"dataset": "dag_id", ...}.
ROLLBACK_DAG_ENV = "BATCH_INFERENCE_ROLLBACK_DAG"
STATIC = Path(__file__).with_name("static")
_CONNINFO_TTL_S = 60.0  # re-read the Airflow connection now and then, so an edit takes effect
_STATEMENT_TIMEOUT = "15s"  # a dashboard read must never hold the ledger for long


# -- the ledger connection --------------------------------------------------------


class _Conninfo:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._value: str | None = None
        self._at = 0.0

    def get(self) -> str:
        env = os.environ.get(db.DB_ENV)
        if env:
            return env
        with self._lock:
            if self._value is None or time.monotonic() - self._at > _CONNINFO_TTL_S:
                self._value = self._from_airflow()
                self._at = time.monotonic()
            return self._value

    @staticmethod
    def _from_airflow() -> str:
        from batch_inference.hooks.batch_inference import BatchInferenceHook

        conn_id = os.environ.get(CONN_ID_ENV, DEFAULT_CONN_ID)
        try:
            # The hook builds a libpq conninfo from the connection's fields; the
            # postgres provider's get_uri() returns a SQLAlchemy URL libpq
            # rejects and loses a Unix-socket host. migrate=False: the
            # dashboard reads, it never changes the schema.
            return BatchInferenceHook(conn_id, migrate=False).get_conninfo()
        except Exception as exc:  # noqa: BLE001 - reported to the caller as 503
            raise HTTPException(status.HTTP_503_SERVICE_UNAVAILABLE,
                                f"ledger connection {conn_id!r} is not usable: {_first_line(exc)}") from None


conninfo = _Conninfo()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else exc.__class__.__name__


def ledger() -> Iterator[psycopg.Connection]:
    """One short-lived connection per request (a Unix socket or a pooler makes this cheap)."""
    try:
        conn = db.connect(conninfo.get(), application_name="batch-inference-dashboard")
    except db.DatabaseUnavailable as exc:
        raise HTTPException(status.HTTP_503_SERVICE_UNAVAILABLE, str(exc)) from None
    try:
        conn.execute(f"SET statement_timeout = '{_STATEMENT_TIMEOUT}'")
        yield conn
    finally:
        conn.close()


Ledger = Annotated[psycopg.Connection, Depends(ledger)]


# -- auth -------------------------------------------------------------------------


def rollback_dag_id(dataset: str) -> str | None:
    """The DAG whose trigger permission a rollback of ``dataset`` needs.

    None when not configured: the check is then made without a DAG id, the
    stricter side (the FAB auth manager then requires permission on every
    DAG; the simple auth manager decides by role either way).
    """
    raw = os.environ.get(ROLLBACK_DAG_ENV, "").strip()
    if not raw:
        return None
    if raw.startswith("{"):
        try:
            mapping = json.loads(raw)
        except ValueError:
            # Refuse rather than fall back to a weaker check.
            raise HTTPException(status.HTTP_503_SERVICE_UNAVAILABLE,
                                f"{ROLLBACK_DAG_ENV} is not valid JSON; rollback is off until it is fixed") from None
        return mapping.get(dataset) or mapping.get("*")
    return raw


def _auth_manager():
    from airflow.api_fastapi.app import get_auth_manager

    return get_auth_manager()


def authorize_rollback(dataset: str, user: GetUserDep) -> BaseUser:
    from airflow.configuration import conf

    dag_id = rollback_dag_id(dataset)
    team = None
    if dag_id and conf.getboolean("core", "multi_team", fallback=False):
        from airflow.models.dag import DagModel

        team = DagModel.get_team_name(dag_id)
    allowed = _auth_manager().is_authorized_dag(
        method="POST", access_entity=DagAccessEntity.RUN, details=DagDetails(id=dag_id, team_name=team), user=user)
    if not allowed:
        raise HTTPException(status.HTTP_403_FORBIDDEN,
                            f"user {user.get_name()!r} may not trigger {dag_id or 'DAG runs'}; rollback refused")
    return user


def same_origin(request: Request) -> None:
    """Refuse a cross-site POST: a browser always sends Origin on one."""
    origin = request.headers.get("origin")
    if origin and origin != "null":
        if urlparse(origin).netloc != request.headers.get("host", ""):
            raise HTTPException(status.HTTP_403_FORBIDDEN, "cross-origin request refused")
    ctype = request.headers.get("content-type", "")
    if not ctype.split(";")[0].strip().lower() == "application/json":
        # A form post from another site cannot send application/json without
        # a CORS preflight, which Airflow does not grant to other origins.
        raise HTTPException(status.HTTP_415_UNSUPPORTED_MEDIA_TYPE, "send the body as application/json")


async def optional_user(request: Request,
                        bearer: HTTPAuthorizationCredentials | None = Depends(bearer_scheme)) -> BaseUser | None:
    """The signed-in user, or None: a page without a user redirects to Airflow's login."""
    try:
        return await get_user(request, None, bearer)
    except HTTPException:
        return None


def _login_redirect(request: Request) -> Response:
    try:
        url = _auth_manager().get_url_login(next_url=str(request.url))
    except Exception:  # noqa: BLE001 - no auth manager (not inside the API server)
        url = "/auth/login?" + urlencode({"next": str(request.url)})
    return RedirectResponse(url, status_code=status.HTTP_303_SEE_OTHER)


# -- the app ----------------------------------------------------------------------

# The interactive docs page loads its JavaScript from a CDN, so it is off;
# /batch-inference/openapi.json still describes every endpoint.
app = FastAPI(title="Batch inference dashboard", docs_url=None, redoc_url=None)


def _page(request: Request, view: str, **attrs: str) -> HTMLResponse:
    base = request.scope.get("root_path", "").rstrip("/")
    extra = "".join(f' data-{k.replace("_", "-")}="{html.escape(v)}"' for k, v in attrs.items())
    body = (STATIC / "page.html").read_text()
    body = body.replace("{{BASE}}", html.escape(base)).replace("{{VIEW}}", view).replace("{{ATTRS}}", extra)
    # The shell holds no data; no-store keeps a signed-out browser from showing a cached page.
    return HTMLResponse(body, headers={"Cache-Control": "no-store"})


@app.get("/", response_class=HTMLResponse, include_in_schema=False)
def jobs_page(request: Request, user: Annotated[BaseUser | None, Depends(optional_user)]) -> Response:
    if user is None:
        return _login_redirect(request)
    return _page(request, "jobs")


@app.get("/jobs/{job_version}", response_class=HTMLResponse, include_in_schema=False)
def job_page(job_version: str, request: Request,
             user: Annotated[BaseUser | None, Depends(optional_user)]) -> Response:
    if user is None:
        return _login_redirect(request)
    return _page(request, "job", job_version=job_version)


@app.get("/run", include_in_schema=False)
def run_page(request: Request, user: Annotated[BaseUser | None, Depends(optional_user)],
             dag_id: str | None = None, run_id: str | None = None, job_version: str | None = None) -> Response:
    """The DAG-run tab: this run's job version, from ?job_version= or the run's conf and XComs."""
    if user is None:
        return _login_redirect(request)
    base = request.scope.get("root_path", "").rstrip("/")
    if job_version:
        return RedirectResponse(f"{base}/jobs/{job_version}", status_code=status.HTTP_303_SEE_OTHER)
    return _page(request, "run", dag_id=dag_id or "", run_id=run_id or "")


@app.get("/static/{name}", include_in_schema=False)
def static_file(name: str) -> Response:
    path = STATIC / name
    if name not in {"dashboard.js", "dashboard.css"} or not path.is_file():
        raise HTTPException(status.HTTP_404_NOT_FOUND)
    media = "text/javascript" if name.endswith(".js") else "text/css"
    return FileResponse(path, media_type=media, headers={"Cache-Control": "no-cache"})


api = APIRouter(prefix="/api", dependencies=[Depends(requires_authenticated())])


def _unknown(exc: UnknownJob) -> HTTPException:
    return HTTPException(status.HTTP_404_NOT_FOUND, str(exc.args[0] if exc.args else exc))


@api.get("/jobs")
def api_jobs(conn: Ledger, dataset: str | None = None,
             limit: Annotated[int, Query(ge=1, le=1000)] = 200) -> dict[str, Any]:
    return {"jobs": data.jobs(conn, dataset, limit)}


@api.get("/jobs/{job_version}")
def api_job(job_version: str, conn: Ledger) -> dict[str, Any]:
    try:
        return data.job(conn, job_version)
    except UnknownJob as exc:
        raise _unknown(exc) from None


@api.get("/jobs/{job_version}/progress")
def api_progress(job_version: str, conn: Ledger) -> dict[str, Any]:
    try:
        return data.progress(conn, job_version)
    except UnknownJob as exc:
        raise _unknown(exc) from None


@api.get("/jobs/{job_version}/shards")
def api_shards(job_version: str, conn: Ledger, limit: Annotated[int, Query(ge=1, le=5000)] = 500,
               offset: Annotated[int, Query(ge=0)] = 0) -> dict[str, Any]:
    try:
        return data.shards(conn, job_version, limit, offset)
    except UnknownJob as exc:
        raise _unknown(exc) from None


@api.get("/jobs/{job_version}/dead-letters")
def api_dead_letters(job_version: str, conn: Ledger, limit: Annotated[int, Query(ge=1, le=1000)] = 100,
                     offset: Annotated[int, Query(ge=0)] = 0) -> dict[str, Any]:
    try:
        return data.dead_letters(conn, job_version, limit, offset)
    except UnknownJob as exc:
        raise _unknown(exc) from None


@api.get("/jobs/{job_version}/cost")
def api_cost(job_version: str, conn: Ledger) -> dict[str, Any]:
    try:
        return data.cost(conn, job_version)
    except UnknownJob as exc:
        raise _unknown(exc) from None


@api.get("/jobs/{job_version}/drift")
def api_drift(job_version: str, conn: Ledger) -> dict[str, Any]:
    try:
        return data.drift(conn, job_version)
    except UnknownJob as exc:
        raise _unknown(exc) from None


@api.get("/datasets/{dataset}/history")
def api_history(dataset: str, conn: Ledger, limit: Annotated[int, Query(ge=1, le=1000)] = 50) -> dict[str, Any]:
    return data.history(conn, dataset, limit)


@api.post("/datasets/{dataset}/rollback", dependencies=[Depends(same_origin)])
def api_rollback(dataset: str, conn: Ledger, user: Annotated[BaseUser, Depends(authorize_rollback)],
                 body: Annotated[dict[str, Any], Body()]) -> dict[str, Any]:
    """Switch the dataset's pointer back to the version the current one replaced.

    Body: ``expected_current``, the version the user saw as published (the
    switch is refused with 409 if the pointer moved since: ``bi.rollback_v2``
    checks it in the switching statement), and an optional
    ``reason``. Repeated rollbacks walk back through the publishes. After the
    switch, the dataset's Asset gets an event, as after a RollbackOperator;
    ``asset_event`` in the answer is its id, or null when none was recorded.
    """
    try:
        result = actions.rollback(conn, dataset, actor=f"airflow:{user.get_name()}",
                                  expected_current=body.get("expected_current"), reason=body.get("reason"))
    except actions.Conflict as exc:
        raise HTTPException(status.HTTP_409_CONFLICT, str(exc)) from None
    except actions.Refused as exc:
        raise HTTPException(422, str(exc)) from None
    event = record_asset_event(dataset, result)
    return {**result, "asset_event": event, "history": data.history(conn, dataset)["history"]}


def record_asset_event(dataset: str, switch: dict[str, Any]) -> int | None:
    """Record an event of the dataset's Asset (``dataset_asset``) in Airflow's metadata database.

    The ``extra`` is the RollbackOperator's (``switch_extra``), so DAGs
    scheduled on the asset run on the restored version whichever way it was
    rolled back. The asset exists once a DAG with it as an outlet has been
    parsed; without it, or without a usable metadata database, the rollback
    stands and a warning is logged. Returns the event's id, or None.
    """
    from sqlalchemy import select

    from airflow.assets.manager import asset_manager
    from airflow.models.asset import AssetModel
    from airflow.utils.session import create_session
    from batch_inference.operators.publish import dataset_asset, switch_extra

    asset = dataset_asset(dataset)
    try:
        with create_session() as session:
            model = session.scalar(select(AssetModel).where(AssetModel.name == asset.name,
                                                            AssetModel.uri == asset.uri))
            if model is None:
                log.warning("rolled back %s, but Airflow has no asset %s (no parsed DAG has it as an outlet): "
                            "no asset event recorded", dataset, asset.uri)
                return None
            event = asset_manager.register_asset_change(asset=model, extra=switch_extra(switch),
                                                        source_is_api=True, session=session)
            if event is None:
                return None
            session.flush()
            return int(event.id)
    except Exception as exc:  # noqa: BLE001 - the pointer has moved; the event is the extra
        log.warning("rolled back %s, but its asset event was not recorded: %s", dataset, _first_line(exc))
        return None


def _xcom_job_version(value: Any) -> str | None:
    """A job version out of an XCom value: the submit manifest dict, or the bare id."""
    if isinstance(value, str) and value.startswith("jv_"):
        return value
    if isinstance(value, dict):
        jv = value.get("job_version")
        if isinstance(jv, str) and jv:
            return jv
    return None


def find_run_job_version(dag_id: str, run_id: str) -> str | None:
    """This DAG run's job version: ``conf["job_version"]``, else the newest XCom that carries one."""
    from sqlalchemy import select

    from airflow.models.dagrun import DagRun
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session

    with create_session() as session:
        run = session.scalar(select(DagRun).where(DagRun.dag_id == dag_id, DagRun.run_id == run_id))
        if run is None:
            raise HTTPException(status.HTTP_404_NOT_FOUND, f"no DAG run {dag_id}/{run_id}")
        jv = (run.conf or {}).get("job_version") if isinstance(run.conf, dict) else None
        if isinstance(jv, str) and jv:
            return jv
        rows = session.scalars(
            select(XComModel).where(XComModel.dag_id == dag_id, XComModel.run_id == run_id)
            .order_by(XComModel.timestamp.desc())).all()
        for row in rows:
            found = _xcom_job_version(XComModel.deserialize_value(row))
            if found:
                return found
    return None


@api.get("/runs/job", dependencies=[Depends(requires_access_dag("GET", DagAccessEntity.XCOM))])
def api_run_job(dag_id: str, run_id: str) -> dict[str, Any]:
    """The job version a DAG run worked on (the DAG-run tab asks this first)."""
    return {"dag_id": dag_id, "run_id": run_id, "job_version": find_run_job_version(dag_id, run_id)}


app.include_router(api)


@app.exception_handler(psycopg.errors.QueryCanceled)
def _timeout(_request: Request, exc: psycopg.errors.QueryCanceled) -> Response:
    return Response(json.dumps({"detail": f"the ledger query ran past {_STATEMENT_TIMEOUT}"}),
                    status_code=status.HTTP_503_SERVICE_UNAVAILABLE, media_type="application/json")
