"""The dashboard: a FastAPI app that ``airflow api-server`` mounts at /batch-inference.

Pages are static shells (HTML, one script, one stylesheet, all served from
this package: no CDN, no web fonts, so the page works on an air-gapped
cluster); every number on them comes from a JSON endpoint under ``/api``,
so what the page shows and what a script can fetch are the same thing.

Airflow does not authenticate plugin routes, so this app does it itself with
Airflow's own dependencies: every ``/api`` route requires an authenticated
Airflow user (a Bearer token or the UI's ``_token`` cookie). What that user
reads is narrowed twice:

- by the auth manager: a job version is readable when the user may read the
  runs of one of the DAGs that worked on it (``bi.job_runs``;
  ``is_authorized_dag(method="GET", access_entity=RUN)``), a dataset when the
  user may read one of its versions' DAGs; a version or dataset no DAG run
  has needs that permission with no DAG id (every DAG);
- by the database: customer text (dead letters, validation examples) is
  read as the user's reader role (``bi.dashboard_readers``, ``SET LOCAL
  ROLE`` in ``data.reading_as``), so row-level security filters it as it
  would that role's own SELECT. An unmapped user reads counts only.

The two writes: rollback requires the auth manager to allow that user to
trigger the dataset's DAG (``is_authorized_dag(method="POST", access_entity=RUN)``),
the same check Airflow applies to ``POST /api/v2/dags/{dag_id}/dagRuns``; a
review verdict on a row of the review sample requires the edit right on a DAG
that ran the version (``method="PUT"``) and a reader role that may read the
row. Both are POST-only with a JSON body and a same-origin check, so a page on
another site cannot forge them with the user's cookie. Every response carries a
Content-Security-Policy that lets the page load only this app's own files and
be framed only by its own origin (Airflow's UI shows it in an iframe).

The ledger database is found, in order, from ``$BATCH_INFERENCE_DB`` (a
documented deployment option, docs/dashboard.md) or the Airflow connection
named by ``$BATCH_INFERENCE_CONN_ID`` (default ``batch_inference_default``), resolved
by ``batch_inference.hooks.connection.ledger_conninfo`` as for every task.
"""

from __future__ import annotations

import html
import json
import logging
import os
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import urlencode, urlparse

import psycopg
from fastapi import APIRouter, Body, Depends, FastAPI, HTTPException, Query, Request, status
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, RedirectResponse, Response
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

from batch_inference import db, evaluation
from batch_inference.exceptions import ReviewRefused
from batch_inference.hooks.connection import DEFAULT_CONN_ID
from batch_inference.status import UnknownJob
from batch_inference.ui import actions, data

log = logging.getLogger(__name__)

CONN_ID_ENV = "BATCH_INFERENCE_CONN_ID"
# Which DAG's "trigger" permission a rollback of a dataset needs: one DAG id
# for every dataset, or a JSON object {"dataset": "dag_id", ...}.
ROLLBACK_DAG_ENV = "BATCH_INFERENCE_ROLLBACK_DAG"
STATIC = Path(__file__).with_name("static")
_CONNINFO_TTL_S = 60.0  # re-read the Airflow connection now and then, so an edit takes effect
_STATEMENT_TIMEOUT = "15s"  # a dashboard read must never hold the ledger for long
MAX_OFFSET = 2**31 - 1  # paging past this is a mistake; the database's OFFSET is a bigint
MAX_REASON = 2000  # characters of a rollback reason
# The page loads only this app's own script and stylesheet and talks only to
# its own /api; only its own origin may frame it (Airflow's UI iframe).
SECURITY_HEADERS = {
    "Content-Security-Policy": ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                                "connect-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'self'"),
    "X-Frame-Options": "SAMEORIGIN",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
}


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
        from batch_inference.hooks.connection import ledger_conninfo

        conn_id = os.environ.get(CONN_ID_ENV, DEFAULT_CONN_ID)
        try:
            return ledger_conninfo(conn_id)   # the tasks' resolver: the same conninfo, IAM token included
        except Exception as exc:  # noqa: BLE001 - reported to the caller as 503
            raise HTTPException(status.HTTP_503_SERVICE_UNAVAILABLE,
                                f"ledger connection {conn_id!r} is not usable: {_first_line(exc)}") from None


conninfo = _Conninfo()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else exc.__class__.__name__


class TimedConnection(psycopg.Connection):
    """The dashboard's connection: every transaction it runs starts with the
    statement timeout set for that transaction only (``SET LOCAL``), and a
    statement outside a transaction runs in one of its own. Nothing is left
    on the session, so behind a transaction pooler the limit never stays on a
    server connection that another client gets next (docs/capacity.md)."""

    def execute(self, query, params=None, **kwargs):
        if self.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
            return super().execute(query, params, **kwargs)
        with self.transaction():
            return super().execute(query, params, **kwargs)

    @contextmanager
    def transaction(self, *args, **kwargs):
        outermost = self.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
        with super().transaction(*args, **kwargs) as tx:
            if outermost:
                super().execute(db.q("statement_timeout"), {"timeout": _STATEMENT_TIMEOUT})
            yield tx


def ledger() -> Iterator[psycopg.Connection]:
    """One short-lived connection per request (a Unix socket or a pooler makes this cheap)."""
    try:
        conn = db.connect(conninfo.get(), application_name="batch-inference-dashboard",
                          connection_class=TimedConnection)
    except db.DatabaseUnavailable as exc:
        raise HTTPException(status.HTTP_503_SERVICE_UNAVAILABLE, str(exc)) from None
    try:
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


def _dag_details(dag_id: str | None) -> DagDetails:
    """The auth manager's details of a DAG (its team in a multi-team deployment); None: every DAG."""
    from airflow.configuration import conf

    team = None
    if dag_id and conf.getboolean("core", "multi_team", fallback=False):
        from airflow.models.dag import DagModel

        team = DagModel.get_team_name(dag_id)
    return DagDetails(id=dag_id, team_name=team)


def readable_dags(user: BaseUser, dag_ids: Iterable[str]) -> set[str]:
    """The DAGs among ``dag_ids`` whose runs the auth manager lets ``user`` read."""
    am = _auth_manager()
    return {d for d in dag_ids if am.is_authorized_dag(method="GET", access_entity=DagAccessEntity.RUN,
                                                       details=_dag_details(d), user=user)}


def reads_every_dag(user: BaseUser) -> bool:
    """Whether ``user`` may read the runs of every DAG: what a job no DAG run has needs."""
    return _auth_manager().is_authorized_dag(method="GET", access_entity=DagAccessEntity.RUN,
                                             details=_dag_details(None), user=user)


@dataclass(frozen=True)
class Reader:
    """The signed-in user, and the database role it reads customer text as (None: counts only)."""

    user: BaseUser
    role: str | None


def reader(user: GetUserDep, conn: Ledger) -> Reader:
    role, problem = data.reader_role(conn, user.get_name())
    if problem:
        log.warning("dashboard user %r reads no customer text: %s", user.get_name(), problem)
    return Reader(user, role)


def _require_read(user: BaseUser, dags: list[str], what: str) -> None:
    allowed = bool(readable_dags(user, dags)) if dags else reads_every_dag(user)
    if not allowed:
        raise HTTPException(status.HTTP_403_FORBIDDEN, f"user {user.get_name()!r} may not read the DAG runs of {what}")


def job_reader(job_version: str, conn: Ledger, who: Annotated[Reader, Depends(reader)]) -> Reader:
    """The reader of one job version: 403 unless it may read a DAG that ran it."""
    _require_read(who.user, data.run_dags(conn, job_version=job_version), f"job version {job_version}")
    return who


def dataset_reader(dataset: str, conn: Ledger, who: Annotated[Reader, Depends(reader)]) -> Reader:
    """The reader of one dataset: 403 unless it may read a DAG that ran one of its versions."""
    _require_read(who.user, data.run_dags(conn, dataset=dataset), f"dataset {dataset}")
    return who


JobReader = Annotated[Reader, Depends(job_reader)]
DatasetReader = Annotated[Reader, Depends(dataset_reader)]


def authorize_rollback(dataset: str, user: GetUserDep) -> BaseUser:
    dag_id = rollback_dag_id(dataset)
    allowed = _auth_manager().is_authorized_dag(
        method="POST", access_entity=DagAccessEntity.RUN, details=_dag_details(dag_id), user=user)
    if not allowed:
        raise HTTPException(status.HTTP_403_FORBIDDEN,
                            f"user {user.get_name()!r} may not trigger {dag_id or 'DAG runs'}; rollback refused")
    return user


def may_review(conn: psycopg.Connection, user: BaseUser, job_version: str) -> bool:
    """Whether ``user`` may record reviews of ``job_version``: the edit right on a DAG that ran it
    (``is_authorized_dag(method="PUT")``, the right to change the DAG), on every DAG when none did."""
    dags = data.run_dags(conn, job_version=job_version)
    am = _auth_manager()
    return any(am.is_authorized_dag(method="PUT", details=_dag_details(d), user=user) for d in (dags or [None]))


def authorize_review(job_version: str, conn: Ledger, who: Annotated[Reader, Depends(job_reader)]) -> Reader:
    if not may_review(conn, who.user, job_version):
        raise HTTPException(status.HTTP_403_FORBIDDEN, f"user {who.user.get_name()!r} may not edit the DAG that ran "
                                                       f"{job_version}; review refused")
    return who


def same_origin(request: Request) -> None:
    """Refuse a cross-site POST: a browser always sends Origin on one.

    The Origin must be this server's own (the Host header, or the host of
    Airflow's ``[api] base_url`` behind a proxy). ``Origin: null`` (a sandboxed
    frame, a data: URL, a redirect across sites) is refused like any other
    foreign origin, and so is a browser's ``Sec-Fetch-Site: cross-site``.
    """
    from airflow.configuration import conf

    origin = request.headers.get("origin")
    if origin is not None:
        own = {request.headers.get("host", ""), urlparse(conf.get("api", "base_url", fallback="") or "").netloc} - {""}
        parsed = urlparse(origin)
        if parsed.scheme not in ("http", "https") or parsed.netloc not in own:
            raise HTTPException(status.HTTP_403_FORBIDDEN, "cross-origin request refused")
    if request.headers.get("sec-fetch-site", "same-origin") not in ("same-origin", "none"):
        raise HTTPException(status.HTTP_403_FORBIDDEN, "cross-site request refused")
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
def no_nul(request: Request) -> None:
    """Refuse a NUL character in the path or query: PostgreSQL text cannot hold one."""
    if "\x00" in request.url.path or any("\x00" in k or "\x00" in v for k, v in request.query_params.multi_items()):
        raise HTTPException(status.HTTP_400_BAD_REQUEST, "the URL contains a NUL character")


app = FastAPI(title="Batch inference dashboard", docs_url=None, redoc_url=None, dependencies=[Depends(no_nul)])


@app.middleware("http")
async def security_headers(request: Request, call_next):
    response = await call_next(request)
    for name, value in SECURITY_HEADERS.items():
        response.headers.setdefault(name, value)
    return response


@app.exception_handler(RequestValidationError)
def _invalid_request(_request: Request, exc: RequestValidationError) -> Response:
    """One line naming the first bad field, not FastAPI's list of error objects."""
    errors = exc.errors()
    first = errors[0] if errors else {}
    loc = [str(p) for p in first.get("loc", ()) if p not in ("query", "path", "body")]
    where = ".".join(loc) or "request"
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return JSONResponse({"detail": f"{where}: {first.get('msg', 'invalid')}{more}"},
                        status_code=422)


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


@app.get("/jobs/{job_version}/review", response_class=HTMLResponse, include_in_schema=False)
def review_page(job_version: str, request: Request,
                user: Annotated[BaseUser | None, Depends(optional_user)]) -> Response:
    if user is None:
        return _login_redirect(request)
    return _page(request, "review", job_version=job_version)


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


Offset = Annotated[int, Query(ge=0, le=MAX_OFFSET)]


@api.get("/jobs")
def api_jobs(conn: Ledger, who: Annotated[Reader, Depends(reader)], dataset: str | None = None,
             limit: Annotated[int, Query(ge=1, le=1000)] = 200, companions: bool = False) -> dict[str, Any]:
    """The newest job versions the user may read (a DAG that ran it is readable); companion
    versions (golden runs, judges) only with ``companions=true``, else under the version they serve."""
    dags = readable_dags(who.user, data.run_dags(conn))
    return {"jobs": data.jobs(conn, dataset, limit, dags=sorted(dags), undagged=reads_every_dag(who.user),
                              companions=companions)}


@api.get("/jobs/{job_version}")
def api_job(job_version: str, conn: Ledger, who: JobReader) -> dict[str, Any]:
    return data.job(conn, job_version, role=who.role)


@api.get("/jobs/{job_version}/progress")
def api_progress(job_version: str, conn: Ledger, _who: JobReader) -> dict[str, Any]:
    return data.progress(conn, job_version)


@api.get("/jobs/{job_version}/shards")
def api_shards(job_version: str, conn: Ledger, _who: JobReader,
               limit: Annotated[int, Query(ge=1, le=5000)] = 500, offset: Offset = 0) -> dict[str, Any]:
    return data.shards(conn, job_version, limit, offset)


@api.get("/jobs/{job_version}/dead-letters")
def api_dead_letters(job_version: str, conn: Ledger, who: JobReader,
                     limit: Annotated[int, Query(ge=1, le=1000)] = 100, offset: Offset = 0) -> dict[str, Any]:
    """The dead letters the user's reader role may read (row-level security), and how many it may not."""
    return data.dead_letters(conn, job_version, limit, offset, role=who.role)


@api.get("/jobs/{job_version}/cost")
def api_cost(job_version: str, conn: Ledger, _who: JobReader) -> dict[str, Any]:
    return data.cost(conn, job_version)


@api.get("/jobs/{job_version}/ladder")
def api_ladder(job_version: str, conn: Ledger, _who: JobReader) -> dict[str, Any]:
    """A ladder job's rungs: share of records, golden accuracy and cost (``ladder`` null for one model)."""
    return data.ladder(conn, job_version)


@api.get("/jobs/{job_version}/drift")
def api_drift(job_version: str, conn: Ledger, _who: JobReader) -> dict[str, Any]:
    return data.drift(conn, job_version)


@api.get("/jobs/{job_version}/review")
def api_review(job_version: str, conn: Ledger, who: JobReader) -> dict[str, Any]:
    """The review sample as the user's reader role sees it, the review gate's progress, and whether
    this user may record verdicts (``may_review``)."""
    out = data.review(conn, job_version, role=who.role)   # UnknownJob: 404 by the app's handler
    return {**out, "may_review": may_review(conn, who.user, job_version), "reads_text": who.role is not None}


@api.post("/jobs/{job_version}/review", dependencies=[Depends(same_origin)])
def api_record_review(job_version: str, conn: Ledger, who: Annotated[Reader, Depends(authorize_review)],
                      body: Annotated[dict[str, Any], Body()]) -> dict[str, Any]:
    """Record a verdict on one row of the review sample: ``record_id``, ``verdict`` (right, wrong
    or unsure) and an optional ``comment``, stored with the user's Airflow identity. The row must
    be one the user's reader role may read: nobody signs off on text they were not shown."""
    record_id, verdict, comment = _review_body(body)
    if who.role is None:
        raise HTTPException(status.HTTP_403_FORBIDDEN, f"user {who.user.get_name()!r} reads no customer text "
                                                       "(no reader role), so it cannot review a row")
    with data.reading_as(conn, who.role):
        seen = conn.execute(db.q("review_visible"), {"job": job_version, "record": record_id}).fetchone()["n"]
    if not seen:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no row {record_id!r} in the review sample of {job_version} "
                                                       "that your reader role may read")
    try:
        recorded = evaluation.record_review(conn, job_version, record_id, verdict,
                                            reviewer=f"airflow:{who.user.get_name()}", comment=comment)
    except ReviewRefused as exc:
        raise HTTPException(422, str(exc)) from None
    return {"recorded": recorded, "review": evaluation.review_state(conn, job_version)}


@api.post("/jobs/{job_version}/reject", dependencies=[Depends(same_origin)])
def api_reject(job_version: str, conn: Ledger, who: Annotated[Reader, Depends(authorize_review)],
               body: Annotated[dict[str, Any], Body()]) -> dict[str, Any]:
    """Reject the whole version, ``reason`` required, with the user's Airflow identity: publish
    refuses it, forced or not, while the rejection stands (``bi.publish_v1``)."""
    reason = body.get("reason")
    if not isinstance(reason, str) or not reason.strip():
        raise HTTPException(422, "reason is required")
    try:
        rejected = evaluation.record_rejection(conn, job_version, reviewer=f"airflow:{who.user.get_name()}",
                                               reason=reason)
    except ReviewRefused as exc:
        raise HTTPException(422, str(exc)) from None
    return {"rejected": rejected, "review": evaluation.review_state(conn, job_version)}


def _review_body(body: dict[str, Any]) -> tuple[str, str, str | None]:
    out: list[str | None] = []
    for key, most, required in (("record_id", 1000, True), ("verdict", 20, True),
                                ("comment", evaluation.MAX_COMMENT, False)):
        value = body.get(key)
        if value is None and required:
            raise HTTPException(422, f"{key} is required")
        if value is not None and not isinstance(value, str):
            raise HTTPException(422, f"{key} must be a string, not {type(value).__name__}")
        if value is not None and len(value) > most:
            raise HTTPException(422, f"{key} is longer than {most:,} characters")
        out.append(value)
    return out[0], out[1], out[2]  # type: ignore[return-value]


@api.get("/datasets/{dataset}/history")
def api_history(dataset: str, conn: Ledger, _who: DatasetReader,
                limit: Annotated[int, Query(ge=1, le=1000)] = 50) -> dict[str, Any]:
    return data.history(conn, dataset, limit)


@api.get("/datasets/{dataset}/estimates")
def api_estimates(dataset: str, conn: Ledger, _who: DatasetReader,
                  limit: Annotated[int, Query(ge=1, le=100)] = 5) -> dict[str, Any]:
    """The dataset's newest previews before a run and pilots (``batch_inference.estimate``)."""
    return data.estimates(conn, dataset, limit)


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
    expected_current, reason = _rollback_body(body)
    try:
        result = actions.rollback(conn, dataset, actor=f"airflow:{user.get_name()}",
                                  expected_current=expected_current, reason=reason)
    except actions.Conflict as exc:
        raise HTTPException(status.HTTP_409_CONFLICT, str(exc)) from None
    except actions.Refused as exc:
        raise HTTPException(422, str(exc)) from None
    event = record_asset_event(dataset, result)
    return {**result, "asset_event": event, "history": data.history(conn, dataset)["history"]}


def _rollback_body(body: dict[str, Any]) -> tuple[str | None, str | None]:
    """``expected_current`` and ``reason`` out of a rollback body, each a string or absent (422 otherwise)."""
    out: list[str | None] = []
    for key, most in (("expected_current", 200), ("reason", MAX_REASON)):
        value = body.get(key)
        if value is not None and not isinstance(value, str):
            raise HTTPException(422, f"{key} must be a string, not {type(value).__name__}")
        if value is not None and "\x00" in value:
            raise HTTPException(422, f"{key} contains a NUL character")
        if value is not None and len(value) > most:
            raise HTTPException(422, f"{key} is longer than {most:,} characters")
        out.append(value)
    return out[0], out[1]


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


@app.exception_handler(UnknownJob)
def _unknown_job(_request: Request, exc: UnknownJob) -> Response:
    """A job version the ledger does not have: 404 with its one line, from any route."""
    return JSONResponse({"detail": str(exc.args[0] if exc.args else exc)}, status_code=status.HTTP_404_NOT_FOUND)


@app.exception_handler(psycopg.DataError)
def _bad_value(_request: Request, exc: psycopg.DataError) -> Response:
    """A value the database cannot take (out of range, not text): the caller's mistake, one line."""
    return JSONResponse({"detail": f"the ledger refused a value of this request: {_first_line(exc)}"},
                        status_code=status.HTTP_400_BAD_REQUEST)


@app.exception_handler(psycopg.errors.InsufficientPrivilege)
def _no_privilege(_request: Request, exc: psycopg.errors.InsufficientPrivilege) -> Response:
    """The dashboard's login cannot take the user's reader role (GRANT it) or read a table."""
    return JSONResponse({"detail": f"the dashboard's database role lacks a privilege: {_first_line(exc)}"},
                        status_code=status.HTTP_503_SERVICE_UNAVAILABLE)


@app.exception_handler(psycopg.errors.UndefinedTable)
@app.exception_handler(psycopg.errors.UndefinedFunction)
def _old_schema(_request: Request, exc: psycopg.Error) -> Response:
    """The ledger lacks a table or function this dashboard reads (say, bi.dashboard_readers): not migrated."""
    return JSONResponse({"detail": f"the ledger's schema is older than this dashboard (apply the migrations): "
                                   f"{_first_line(exc)}"}, status_code=status.HTTP_503_SERVICE_UNAVAILABLE)


@app.exception_handler(psycopg.errors.QueryCanceled)
def _timeout(_request: Request, exc: psycopg.errors.QueryCanceled) -> Response:
    return Response(json.dumps({"detail": f"the ledger query ran past {_STATEMENT_TIMEOUT}"}),
                    status_code=status.HTTP_503_SERVICE_UNAVAILABLE, media_type="application/json")
