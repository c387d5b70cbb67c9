"""Bad input tried as an attacker would, on the real embedded PostgreSQL and
the real CLI: what a job version means (the dataset is part of it), specs
built to hurt the parser or to be accepted and fail later, CLI error paths,
model output that speaks to the terminal, a source query that tries to run a
second statement or to write, local workers that must not inherit Airflow's
secrets, and a trigger form that must not choose the pod's image.

Every vector is one parametrized case; each names what it gets now. The
table in docs/reliability.md ("Bad input") lists the same vectors."""

from __future__ import annotations

import tests.fixtures.airflow_env  # noqa: F401  (before anything imports Airflow)

import json
import os
import subprocess
import sys
import uuid

import pytest

from batch_inference import db
from batch_inference.plan import submit
from batch_inference.publish import publish
from batch_inference.snapshot import SnapshotError
from batch_inference.spec import MAX_LEASE_SECONDS, SpecError, loads_spec, parse_spec
from batch_inference.status import job_counts, job_spec
from batch_inference.validate import validate
from gpu_runner.worker import WorkerConfig, run_worker
from tests.conftest import database_from_template, make_source, make_spec, spec_dict, tickets
from tests.fixtures.cli import cli_here
from tests.fixtures.hostile_specs import SPEC_VECTORS, bomb, spec_yaml
from tests.integration.test_privileges import url_as, worker_role  # noqa: F401  (worker_role: a fixture)

CONN_ID = "bi_test_security"


def _state(conn) -> dict:
    """Everything a refused command must leave as it was."""
    rows = lambda sql: [tuple(r.values()) for r in conn.execute(sql)]  # noqa: E731
    return {
        "jobs": rows("SELECT job_version, dataset, status FROM bi.jobs ORDER BY 1"),
        "grants": rows("SELECT role_name, job_version FROM bi.worker_grants ORDER BY 1, 2"),
        "pointer": rows("SELECT dataset, job_version FROM bi.publish_pointer ORDER BY 1"),
        "tables": rows("SELECT schemaname, tablename FROM pg_tables WHERE schemaname IN ('bi', 'public') "
                       "ORDER BY 1, 2"),
        "shards": rows("SELECT job_version, count(*) FROM bi.shards GROUP BY 1 ORDER BY 1"),
    }


# -- 6. the dataset is part of what a job version means ---------------------------

def test_a_second_dataset_over_the_same_rows_is_its_own_job_version(conn, db_url):
    make_source(conn, tickets(12))
    first = submit(conn, make_spec())
    second = submit(conn, make_spec(dataset="tickets_escalations", engine={"name": "noop", "options": {"seed": 7}},
                                    validation={"max_drift": 0.5}))
    assert second.job_version != first.job_version and second.created
    assert (second.dataset, second.records) == ("tickets_escalations", 12)
    # the second spec's engine and gates are its own, not the first's
    kept = job_spec(conn, second.job_version)
    assert kept.dataset == "tickets_escalations" and kept.validation.max_drift == 0.5
    assert kept.engine.options == {"seed": 7}
    # ... and the same spec again is still the same version, writing nothing
    again = submit(conn, make_spec())
    assert (again.job_version, again.created) == (first.job_version, False)
    # published to its own dataset, the first one untouched
    assert run_worker(WorkerConfig(job_version=second.job_version, db_url=db_url)) == 0
    assert validate(conn, second.job_version)["passed"]
    publish(conn, second.job_version)
    pointer = dict((r["dataset"], r["job_version"]) for r in conn.execute(
        "SELECT dataset, job_version FROM bi.publish_pointer"))
    assert pointer == {"tickets_escalations": second.job_version}


def test_a_dataset_override_in_the_submit_task_is_its_own_job_version(db_url, conn, monkeypatch):
    from batch_inference.hooks.batch_inference import airflow_connection_json
    from batch_inference.operators import SubmitJobOperator

    monkeypatch.setenv(f"AIRFLOW_CONN_{CONN_ID.upper()}", airflow_connection_json(db_url))
    make_source(conn, tickets(5))

    class TI:
        def xcom_push(self, key, value):
            pass

    a = SubmitJobOperator(task_id="s", spec=spec_dict(), postgres_conn_id=CONN_ID).execute({"ti": TI()})
    b = SubmitJobOperator(task_id="s", spec=spec_dict(), postgres_conn_id=CONN_ID,
                          overrides={"dataset": "tickets_other"}).execute({"ti": TI()})
    assert a["job_version"] != b["job_version"] and b["dataset"] == "tickets_other" and b["created"]


# -- 7. spec limits: refused at load, one line, in well under a second -------------

@pytest.mark.parametrize("what,text,words", SPEC_VECTORS, ids=[v[0] for v in SPEC_VECTORS])
def test_a_hostile_spec_is_refused_at_load_in_one_line(what, text, words):
    with pytest.raises(SpecError) as exc:
        loads_spec(text, name="evil.yaml")
    msg = str(exc.value)
    assert "\n" not in msg and len(msg) < 500, msg[:600]
    for w in words:
        assert w in msg, f"{what}: {msg!r} lacks {w!r}"


def test_overrides_are_validated_like_the_spec():
    spec = make_spec()
    for field, value in (("shard_size", 0), ("shard_size", -1), ("lease_seconds", 3_000_000_000),
                         ("dataset", "Bad Name")):
        with pytest.raises(SpecError, match=f"'{field}'"):
            spec.with_overrides(**{field: value})
    assert spec.with_overrides(shard_size=7).shard_size == 7
    with pytest.raises(SpecError, match="NUL"):
        parse_spec({**spec_dict(), "record_class": "a\x00b"})


def test_the_longest_lease_the_spec_accepts_is_one_the_ledger_runs(conn, db_url):
    make_source(conn, tickets(4))
    m = submit(conn, make_spec(lease_seconds=MAX_LEASE_SECONDS))
    assert run_worker(WorkerConfig(job_version=m.job_version, db_url=db_url)) == 0
    assert job_counts(conn, m.job_version)["stored"] == 4


def test_a_record_id_too_long_to_key_a_result_refuses_the_submit(conn):
    import random
    import string

    rng = random.Random(3)
    long_id = "".join(rng.choice(string.ascii_letters) for _ in range(10_000))   # incompressible
    make_source(conn, [*tickets(3), (long_id, "a ticket", None)])
    before = _state(conn)
    with pytest.raises(SnapshotError) as exc:
        submit(conn, make_spec())
    msg = str(exc.value)
    assert "too long to key a result" in msg and "10,000 bytes" in msg and len(msg) < 300
    assert _state(conn) == before


# -- 7. CLI error paths: one line, exit 2, nothing half-written ---------------------

def _cli(db_url: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """The CLI in a subprocess; stdout and stderr decoded as they are (no newline translation)."""
    env = {**os.environ, "BATCH_INFERENCE_DB": db_url}
    p = subprocess.run([sys.executable, "-m", "batch_inference.cli", *args], capture_output=True, env=env,
                       timeout=timeout)
    p.stdout, p.stderr = p.stdout.decode("utf-8", "replace"), p.stderr.decode("utf-8", "replace")
    return p


@pytest.fixture(scope="module")
def refused_db(pg_server, template_db):
    """The database every CLI refusal below runs against: a job version of dataset tickets_triage, done,
    validated and published; a second, unpublished; and a role outside bi_worker. Each refusal asserts
    that it changed nothing, so they share it (a database of their own each cost a clone, a submit, a
    worker run and a publish per vector). Yields (url, connection, job, other job, role)."""
    with database_from_template(pg_server, template_db) as url, db.connect(url) as conn:
        make_source(conn, tickets(6))
        job = submit(conn, make_spec()).job_version
        assert run_worker(WorkerConfig(job_version=job, db_url=url)) == 0
        validate(conn, job)
        publish(conn, job)
        other = submit(conn, make_spec(dataset="tickets_other")).job_version
        role = "bi_test_outsider_" + uuid.uuid4().hex[:8]
        conn.execute(f"CREATE ROLE {role} NOLOGIN")
        yield url, conn, job, other, role
        conn.execute(f"DROP ROLE {role}")


LONG = "x" * 10_000
CLI_VECTORS = [
    # (what, argv with {job}/{other}/{role}/{spec:...} placeholders, words in the error line)
    ("submit --shard-size 0", ["submit", "{spec}", "--shard-size", "0"], ["'shard_size'"]),
    ("submit --shard-size -5", ["submit", "{spec}", "--shard-size", "-5"], ["'shard_size'"]),
    ("submit --shard-size 2000000", ["submit", "{spec}", "--shard-size", "2000000"], ["'shard_size'"]),
    ("submit --shard-size many", ["submit", "{spec}", "--shard-size", "many"], ["--shard-size", "invalid int"]),
    ("submit an alias bomb", ["submit", "{bomb}"], ["aliases"]),
    ("submit lease_seconds 3000000000", ["submit", "{lease}"], ["'lease_seconds'"]),
    ("submit a NUL in a schema enum", ["submit", "{nul}"], ["NUL"]),
    ("submit an output property named ''", ["submit", "{emptyprop}"], ["property ''"]),
    ("grant an unknown role", ["grant", "no_such_role_zz", "{job}"], ["no role no_such_role_zz"]),
    ("grant a role outside bi_worker", ["grant", "{role}", "{job}"], ["not a member of bi_worker"]),
    ("grant an unknown job version", ["grant", "bi_worker", "jv_0000000000000000"], ["no job version"]),
    ("grant a 10,000-character role", ["grant", LONG, "{job}"], ["no role xxx"]),
    ("drop a published version", ["drop", "{job}"], ["is published", "roll back"]),
    ("drop an unknown version", ["drop", "jv_0000000000000000"], ["no job version"]),
    ("drop a 10,000-character id", ["drop", LONG], ["no job version"]),
    ("status of a 10,000-character id", ["status", LONG], ["no job version"]),
    ("dead-letters of a 10,000-character id", ["dead-letters", LONG], ["no job version"]),
    ("publish a 10,000-character id", ["publish", LONG], ["no job version"]),
    ("worker --db-retries -1", ["worker", "{other}", "--db-retries", "-1", "--no-wait"], ["--db-retries"]),
    ("worker --flush-every 0", ["worker", "{other}", "--flush-every", "0", "--no-wait"], ["--flush-every"]),
    ("worker --lease-seconds 3000000000", ["worker", "{other}", "--lease-seconds", "3000000000", "--no-wait"],
     ["--lease-seconds"]),
    ("chaos --workers 0", ["chaos", "--workers", "0"], ["workers must be at least 1"]),
    ("chaos --shard-size 0", ["chaos", "--shard-size", "0"], ["'shard_size'"]),
    ("chaos --faults -1", ["chaos", "--faults", "-1"], ["faults must be at least 0"]),
]


# Through a process of their own: each command's first vector, the alias bomb (a parser that expands it would
# take this process's memory with it) and chaos --workers 0 (which once hung); the others in this process.
OWN_PROCESS = {"submit --shard-size 0", "submit an alias bomb", "grant an unknown role", "drop a published version",
                "status of a 10,000-character id", "dead-letters of a 10,000-character id",
                "publish a 10,000-character id", "worker --db-retries -1", "chaos --workers 0"}


@pytest.mark.parametrize("what,argv,words", CLI_VECTORS, ids=[v[0] for v in CLI_VECTORS])
def test_a_cli_error_is_one_line_exit_2_and_writes_nothing(what, argv, words, tmp_path, refused_db, capfd):
    db_url, conn, job, other, outsider_role = refused_db
    files = {
        "spec": spec_yaml(),
        "bomb": bomb(),
        "lease": spec_yaml(lease_seconds=3_000_000_000),
        "nul": spec_yaml(output_schema={**spec_dict()["output_schema"], "properties": {
            "category": {"type": "string", "enum": ["billing", "bug\x00"]}}}),
        "emptyprop": spec_yaml(output_schema={"type": "object", "properties": {"": {"type": "string"}}}),
    }
    subs = {"{job}": job, "{other}": other, "{role}": outsider_role}
    for name, text in files.items():
        (tmp_path / f"{name}.yaml").write_text(text)
        subs["{" + name + "}"] = str(tmp_path / f"{name}.yaml")
    before = _state(conn)
    args = [subs.get(a, a) for a in argv]
    p = _cli(db_url, *args, timeout=30) if what in OWN_PROCESS else cli_here(capfd, args, {db.DB_ENV: db_url})
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 2, f"{what}: exit {p.returncode}\n{p.stderr[-2000:]}"
    assert p.stdout == "" and len(lines) == 1, f"{what}: {p.stdout[-500:]!r} {p.stderr[-2000:]!r}"
    line = lines[0]
    assert line.startswith(f"batch-inference {argv[0]}: error: ") and "Traceback" not in line, line[:300]
    assert len(line) <= 500, f"{what}: a {len(line)}-character line"
    for w in words:
        assert w in line, f"{what}: {line!r} lacks {w!r}"
    assert _state(conn) == before


def test_cli_grant_and_revoke_still_work(conn, db_url):
    make_source(conn, tickets(3))
    job = submit(conn, make_spec()).job_version
    assert _cli(db_url, "grant", "bi_worker", job).returncode == 0
    assert [r["role_name"] for r in conn.execute("SELECT role_name FROM bi.worker_grants")] == ["bi_worker"]
    assert _cli(db_url, "grant", "bi_worker", job, "--revoke").returncode == 0
    assert conn.execute("SELECT count(*) AS n FROM bi.worker_grants").fetchone()["n"] == 0


# -- 7. model output that speaks to the terminal -----------------------------------

HOSTILE_OUTPUT = {
    "csi-clear": "\x1b[2J\x1b[H",
    "osc-title": "\x1b]0;pwned\x07",
    "c1-csi": "\x9b31m red",
    "bell-backspace": "ok\x08\x08\x07",
    "cr-overwrite": "innocent\rEVIL",
    "bidi-override": "\u202eevil\u202c",
    "del": "a\x7fb",
}


@pytest.mark.parametrize("name", list(HOSTILE_OUTPUT))
def test_dead_letters_print_control_characters_escaped(name, conn, db_url, capfd):
    """The first payload through the CLI's own process, the others through cli.main here: the escaping is
    the printing's, the same in both."""
    payload = HOSTILE_OUTPUT[name]
    make_source(conn, [("rec" + payload, "ticket [[invalid-output]]", None), *tickets(2)])
    m = submit(conn, make_spec(max_attempts=1))
    assert run_worker(WorkerConfig(job_version=m.job_version, db_url=db_url)) == 0
    # the raw output a model might give: written as the worker writes a dead letter's raw output
    conn.execute("UPDATE bi.dead_letters SET raw_output = %s, error = %s WHERE job_version = %s",
                 (payload + '{"category": "bug"}', payload, m.job_version))
    for args in ((), ("--json",)):
        p = (_cli(db_url, "dead-letters", m.job_version, *args) if name == next(iter(HOSTILE_OUTPUT)) else
             cli_here(capfd, ["dead-letters", m.job_version, *args], {db.DB_ENV: db_url}))
        assert p.returncode == 0, p.stderr
        bad = [c for c in p.stdout if (ord(c) < 0x20 and c not in "\n\t") or 0x7f <= ord(c) <= 0x9f
               or c in "\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069"]
        assert bad == [], f"{args}: {bad!r} printed raw"
        if args:
            row = json.loads(p.stdout.split("\n")[0])   # still valid JSON with the exact text
            assert row["raw_output"].startswith(payload) and row["record_id"] == "rec" + payload


# -- 8. a source query: one statement, read-only -----------------------------------

VICTIM = "public.victim"
QUERY_VECTORS = [
    # (what, query, words in the refusal)
    ("a second statement after COMMIT",
     "SELECT id, body, acl FROM public.tickets) AS src) AS s; COMMIT; DROP TABLE public.victim; "
     "SELECT 1 FROM (SELECT 1 FROM (SELECT 1 AS id, 'x' AS body, NULL::text[] AS acl",
     ["single statement"]),
    ("a second statement",
     "SELECT id, body, acl FROM public.tickets) AS src) AS s; DROP TABLE public.victim; "
     "SELECT 1 FROM (SELECT 1 FROM (SELECT 1 AS id, 'x' AS body, NULL::text[] AS acl",
     ["single statement"]),
    ("a write through a function",
     "SELECT id, body, acl FROM public.tickets WHERE bi.drop_job_version_v1('jv_x') IS NOT NULL",
     ["read-only"]),
    ("a data-modifying CTE",
     "WITH d AS (DELETE FROM public.victim RETURNING 1) SELECT id, body, acl FROM public.tickets",
     ["source query"]),
    ("turning read-only off",
     "SELECT id, body, acl FROM public.tickets, "
     "LATERAL (SELECT set_config('transaction_read_only', 'off', true)) AS x",
     ["source query"]),
    ("DDL through a function",
     "SELECT id, body, acl FROM public.tickets, LATERAL (SELECT bi.create_job_partitions_v1('jv_x')) AS x",
     ["read-only"]),
]


@pytest.mark.parametrize("what,query,words", QUERY_VECTORS, ids=[v[0] for v in QUERY_VECTORS])
def test_a_source_query_runs_one_statement_read_only(what, query, words, conn):
    make_source(conn, tickets(3))
    conn.execute(f"CREATE TABLE {VICTIM} (x int)")
    conn.execute(f"INSERT INTO {VICTIM} VALUES (1)")
    before = _state(conn)
    with pytest.raises(SnapshotError) as exc:
        submit(conn, make_spec(source={"table": None, "query": query}))
    msg = str(exc.value)
    assert "\n" not in msg
    for w in words:
        assert w in msg, f"{what}: {msg!r} lacks {w!r}"
    assert _state(conn) == before
    assert conn.execute(f"SELECT count(*) AS n FROM {VICTIM}").fetchone()["n"] == 1
    assert conn.execute("SELECT to_regclass('pg_temp._bi_query') AS t").fetchone()["t"] is None


def test_a_source_query_with_percent_signs_and_its_snapshot_are_exact(conn):
    make_source(conn, [*tickets(4), ("p1", "100% refund, 50%% off", None)])
    query = "SELECT id, body, acl FROM public.tickets WHERE body LIKE '%refund%' OR body LIKE '%charged%'"
    m = submit(conn, make_spec(source={"table": None, "query": query}))
    assert m.records == 5 and m.created
    text = conn.execute("SELECT text FROM bi.snapshot_rows WHERE job_version = %s AND record_id = 'p1'",
                        (m.job_version,)).fetchone()["text"]
    assert text == "100% refund, 50%% off"
    # the same query over the same rows is the same version
    assert submit(conn, make_spec(source={"table": None, "query": query})).job_version == m.job_version


# -- 8. local workers: only the environment they need, their own credentials -------

def test_local_workers_get_only_their_environment_and_their_own_role(conn, db_url, tmp_path, monkeypatch,
                                                                    worker_role):
    from batch_inference.hooks.batch_inference import airflow_connection_json
    from batch_inference.operators import LocalWorkersOperator
    from psycopg.conninfo import conninfo_to_dict

    role = worker_role
    try:
        worker_url = url_as(db_url, role)
        monkeypatch.setenv(f"AIRFLOW_CONN_{CONN_ID.upper()}", airflow_connection_json(db_url))
        monkeypatch.setenv("AIRFLOW_CONN_BI_TEST_WORKER", airflow_connection_json(worker_url))
        secrets = {"AIRFLOW__CORE__FERNET_KEY": "fernet-secret", "AWS_SECRET_ACCESS_KEY": "aws-secret",
                   "BATCH_INFERENCE_ONCALL_WEBHOOK": "https://hooks.example/secret", "SOME_TOKEN": "t0ken"}
        for k, v in secrets.items():
            monkeypatch.setenv(k, v)
        monkeypatch.setenv("MY_ENGINE_KEY", "engine-key")
        monkeypatch.setenv("BATCH_INFERENCE_ENGINE_MODULES", "tests.fixtures.env_engine")
        make_source(conn, tickets(8))
        spec = make_spec(engine={"name": "tests.fixtures.env_engine:EnvDumpEngine",
                                 "options": {"dump_dir": str(tmp_path), "api_key_env": "MY_ENGINE_KEY"}})
        job = submit(conn, spec).job_version
        op = LocalWorkersOperator(task_id="workers", job_version=job, workers=2, postgres_conn_id=CONN_ID,
                                  worker_conn_id="bi_test_worker", env={"EXTRA_FROM_DAG": "1"})
        out = op.execute({})
        assert (out["stored"], out["outstanding"]) == (8, 0)
        dumps = [json.loads(p.read_text()) for p in tmp_path.glob("*.json")]
        assert len(dumps) >= 1
        for env in dumps:
            leaked = sorted(k for k in env if k in secrets or k.startswith(("AIRFLOW_", "AWS_"))
                            or (k.startswith("AIRFLOW__") and k != "AIRFLOW__BATCH_INFERENCE__ALLOWED_ENGINE_MODULES"))
            assert leaked == [], leaked
            assert env["MY_ENGINE_KEY"] == "engine-key" and env["EXTRA_FROM_DAG"] == "1"
            assert conninfo_to_dict(env["BATCH_INFERENCE_DB"])["user"] == role   # not the owner
            assert "PATH" in env
        # the job was granted to the worker role first: without it that role can do nothing
        assert conn.execute("SELECT role_name FROM bi.worker_grants WHERE job_version = %s",
                            (job,)).fetchone()["role_name"] == role
    finally:
        conn.execute("DELETE FROM bi.worker_grants WHERE role_name = %s", (role,))


# -- 8. the GPU DAG's image: only what the DAG's author allows ----------------------

IMAGE_VECTORS = ["evil/miner:latest", "batch-inference-gpu:0.1.0 ", "batch-inference-gpu:latest",
                 "batch-inference-gpu@sha256:" + "0" * 64, ""]


def _gpu_dag():
    from airflow.dag_processing.dagbag import DagBag

    from tests.fixtures.airflow_env import DAGS

    bag = DagBag(dag_folder=str(DAGS / "batch_inference_gpu.py"))
    assert not bag.import_errors, bag.import_errors
    return bag.dags["batch_inference_gpu"]


@pytest.mark.parametrize("image", IMAGE_VECTORS)
def test_the_gpu_dag_offers_and_runs_only_its_allowed_images(image, db_url, monkeypatch):
    from airflow.sdk.exceptions import AirflowFailException

    from batch_inference.hooks.batch_inference import airflow_connection_json
    from batch_inference.operators import GpuWorkerPodOperator

    dag = _gpu_dag()
    param = dag.params.get_param("image")
    allowed = list(param.schema["enum"])
    assert image not in allowed
    with pytest.raises(Exception):
        param.resolve(image)          # the trigger form refuses it
    # and the operator refuses it even if a caller gets past the form (the API, a mapped override)
    monkeypatch.setenv("AIRFLOW_CONN_BATCH_INFERENCE_DEFAULT", airflow_connection_json(db_url))
    op = GpuWorkerPodOperator(task_id="w", job_version="jv_0123456789abcdef", image="{{ params.image }}",
                              allowed_images=allowed)
    op.image = image                  # as rendered from the run's params
    with pytest.raises(AirflowFailException, match="not one of the DAG's allowed runner images"):
        op.execute({})
    # the DAG's own task (the pods it creates and removes) refuses it before the grant and any pod
    task = dag.get_task("gpu_workers")
    task.job_version = "jv_0123456789abcdef"
    task.pod_kwargs = {**task.pod_kwargs, "image": image}   # as rendered from the run's params
    monkeypatch.setattr(task, "hook", lambda: pytest.fail("the Kubernetes hook was reached"))
    with pytest.raises(AirflowFailException, match="not one of the DAG's allowed runner images"):
        task.execute({})
    # a templated image without an allow-list allows nothing
    bare = GpuWorkerPodOperator(task_id="w2", job_version="jv_0123456789abcdef", image="{{ params.image }}")
    bare.image = allowed[0]
    with pytest.raises(AirflowFailException, match="allowed runner images"):
        bare.execute({})
    from batch_inference.operators.gpu_autopilot import GpuAutopilotOperator

    pilot = GpuAutopilotOperator(task_id="w3", job_version="jv_0123456789abcdef",
                                 pod_kwargs={"image": "{{ params.image }}"})
    pilot.pod_kwargs = {**pilot.pod_kwargs, "image": allowed[0]}
    with pytest.raises(AirflowFailException, match="allowed runner images"):
        pilot.execute({})
