"""sql/schema/ and sql/migrations/ build the same database (the real embedded PostgreSQL).

One database is migrated from empty with ``db.migrate``; another runs the
schema files in name order. Their catalogs must agree on every table,
column, constraint, index, function body, grant, policy, trigger and view in
the ledger's schemas. A migration that drifts from the schema (or a schema
edit without its migration) fails here, naming the object.
"""

from __future__ import annotations

import hashlib
import re
from collections import Counter

import pytest

from batch_inference import db

SCHEMAS = ("bi", "published")

# Each probe: a name and a query over the catalogs returning comparable rows.
# bi.schema_migrations (migrate's own record) is left out: only the migrated
# database has it. Columns are compared by name, not position: ALTER TABLE ADD
# COLUMN puts a column last, where the schema file may place it beside its kin.
CATALOG = {
    "columns": """
        SELECT c.table_schema, c.table_name, c.column_name, c.data_type, c.udt_name, c.column_default,
               c.is_nullable, c.is_identity
          FROM information_schema.columns c
         WHERE c.table_schema = ANY (%(schemas)s) AND c.table_name <> 'schema_migrations'""",
    "relations": """
        SELECT n.nspname, c.relname, c.relkind, c.relpersistence, c.relrowsecurity, c.relforcerowsecurity,
               pg_get_partkeydef(c.oid) AS partkey, c.relacl::text AS acl, c.reloptions::text AS options,
               obj_description(c.oid, 'pg_class') AS comment
          FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
         WHERE n.nspname = ANY (%(schemas)s) AND c.relname NOT LIKE 'schema_migrations%%'
           AND c.relkind IN ('r', 'p', 'v', 'm', 'S', 'f')""",
    "constraints": """
        SELECT n.nspname, c.conrelid::regclass::text AS rel, c.conname, c.contype, pg_get_constraintdef(c.oid) AS def
          FROM pg_constraint c JOIN pg_namespace n ON n.oid = c.connamespace
         WHERE n.nspname = ANY (%(schemas)s) AND c.conrelid::regclass::text <> 'bi.schema_migrations'""",
    "indexes": """
        SELECT schemaname, tablename, indexname, indexdef FROM pg_indexes
         WHERE schemaname = ANY (%(schemas)s) AND tablename <> 'schema_migrations'""",
    "functions": """
        SELECT n.nspname, p.proname, pg_get_function_identity_arguments(p.oid) AS args,
               pg_get_functiondef(p.oid) AS def, p.proacl::text AS acl
          FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
         WHERE n.nspname = ANY (%(schemas)s)""",
    "policies": """
        SELECT schemaname, tablename, policyname, permissive, roles::text, cmd, qual, with_check
          FROM pg_policies WHERE schemaname = ANY (%(schemas)s)""",
    "triggers": """
        SELECT c.relname, t.tgname, pg_get_triggerdef(t.oid) AS def, t.tgenabled
          FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid JOIN pg_namespace n ON n.oid = c.relnamespace
         WHERE n.nspname = ANY (%(schemas)s) AND NOT t.tgisinternal""",
    "views": """
        SELECT schemaname, viewname, definition FROM pg_views WHERE schemaname = ANY (%(schemas)s)""",
    "schemas": """
        SELECT nspname, nspacl::text AS acl FROM pg_namespace WHERE nspname = ANY (%(schemas)s)""",
    "default_privileges": """
        SELECT defaclobjtype, defaclnamespace::regnamespace::text AS nsp, defaclacl::text AS acl
          FROM pg_default_acl WHERE defaclrole = (SELECT oid FROM pg_roles WHERE rolname = current_user)""",
    "sequences": """
        SELECT schemaname, sequencename, data_type::text, start_value, increment_by FROM pg_sequences
         WHERE schemaname = ANY (%(schemas)s)""",
}


def catalog(url: str) -> dict[str, list[tuple]]:
    with db.connect(url) as c:
        return {name: sorted(tuple(r.values()) for r in c.execute(sql, {"schemas": list(SCHEMAS)}))
                for name, sql in CATALOG.items()}


def apply_schema(url: str) -> None:
    with db.connect(url) as c, c.transaction():
        for path in sorted((db.sql_dir() / "schema").glob("*.sql")):
            c.execute(path.read_text())


def test_migrations_build_the_schema(empty_db):
    migrated, defined = empty_db(), empty_db()
    with db.connect(migrated) as c:
        assert db.migrate(c) == [p.name for p in db.migrations()]
    apply_schema(defined)
    got, want = catalog(migrated), catalog(defined)
    assert len(want["functions"]) > 30 and len(want["columns"]) > 100   # the probes see the ledger
    for probe in CATALOG:
        only_migrated = sorted(set(got[probe]) - set(want[probe]))
        only_schema = sorted(set(want[probe]) - set(got[probe]))
        assert not only_migrated and not only_schema, (
            f"{probe} differ between sql/migrations/ and sql/schema/:\n"
            f"  migrations only: {only_migrated}\n  schema only: {only_schema}")


def _policy_rules(text: str) -> list[str]:
    """The USING expression of each CREATE POLICY in ``text``, its whitespace collapsed."""
    rules = []
    for start in re.finditer(r"CREATE POLICY\b.*?\bUSING\s*\(", text, re.S):
        depth, i = 1, start.end()
        while depth:
            depth += {"(": 1, ")": -1}.get(text[i], 0)
            i += 1
        rules.append(" ".join(text[start.end():i - 1].split()))
    return rules


def test_the_schema_states_each_function_and_each_row_level_security_rule_once():
    texts = [p.read_text() for p in sorted((db.sql_dir() / "schema").glob("*.sql"))]
    functions = Counter(name.lower() for t in texts
                        for name in re.findall(r"CREATE\s+(?:OR\s+REPLACE\s+)?FUNCTION\s+([\w.]+)\s*\(", t, re.I))
    rules = Counter(rule for t in texts for rule in _policy_rules(t))
    assert "bi.put_results_v3" in functions and len(rules) >= 3
    assert {f: n for f, n in functions.items() if n > 1} == {}
    assert {r: n for r, n in rules.items() if n > 1} == {}


def test_migrate_is_idempotent(empty_db):
    url = empty_db()
    with db.connect(url) as c:
        assert db.migrate(c)
        assert db.migrate(c) == []
        names = [r["name"] for r in c.execute("SELECT name FROM bi.schema_migrations ORDER BY name")]
    assert names == [p.name for p in db.migrations()]


def test_a_changed_migration_is_refused_in_one_line(empty_db):
    url = empty_db()
    with db.connect(url) as c:
        db.migrate(c)
        first = db.migrations()[0].name
        c.execute("UPDATE bi.schema_migrations SET checksum = %s WHERE name = %s",
                  (hashlib.sha256(b"an earlier text").hexdigest(), first))
        with pytest.raises(db.MigrationRefused) as refused:
            db.migrate(c)
    msg = str(refused.value)
    assert "\n" not in msg and first in msg and "never edited" in msg


def test_a_database_from_before_the_squash_is_refused_with_how_to_rebuild(empty_db):
    url = empty_db()
    with db.connect(url) as c:
        c.execute("CREATE SCHEMA bi")
        c.execute("""CREATE TABLE bi.schema_migrations (name text PRIMARY KEY, checksum text NOT NULL,
                     applied_at timestamptz NOT NULL DEFAULT clock_timestamp())""")
        c.execute("INSERT INTO bi.schema_migrations (name, checksum) "
                  "VALUES ('0001_core.sql', 'x'), ('0002_ledger.sql', 'y')")
        with pytest.raises(db.MigrationRefused) as refused:
            db.migrate(c)
        # nothing was applied
        assert c.execute("SELECT to_regclass('bi.jobs') AS t").fetchone()["t"] is None
    msg = str(refused.value)
    assert "\n" not in msg and "predates the schema squash" in msg and "0001_core.sql" in msg
    assert "DROP SCHEMA bi, published CASCADE" in msg


def test_the_fence_is_inlined_into_the_statements_that_change_state(conn):
    """bi.holds_lease_v1 is planned as two comparisons, not a function call per row."""
    conn.execute("SET search_path = pg_catalog, pg_temp")
    plan = "\n".join(r["QUERY PLAN"] for r in conn.execute(
        "EXPLAIN (VERBOSE) UPDATE bi.shards s SET claims = s.claims WHERE s.job_version = 'x' AND s.shard_no = 0 "
        "AND bi.holds_lease_v1(s, 1)"))
    assert "holds_lease_v1" not in plan and "(s.state = 'leased'::text) AND (s.epoch = '1'::bigint)" in plan



def test_every_fenced_transition_reports_a_stale_epoch_in_one_shape(conn):
    """Each function that records a fence event answers one row whose first column is ``stale boolean``."""
    rows = conn.execute("""
        SELECT p.proname, p.proretset,
               (SELECT array_agg(n ORDER BY i) FROM unnest(p.proargnames, p.proargmodes) WITH ORDINALITY AS a(n, m, i)
                 WHERE m IN ('o', 'b')) AS outs,
               (SELECT format_type(t, NULL) FROM unnest(p.proallargtypes, p.proargmodes) AS a(t, m)
                 WHERE m IN ('o', 'b') LIMIT 1) AS first_type
          FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
         WHERE n.nspname = 'bi' AND p.prosrc LIKE '%%bi.record_fence_v1(%%'
         ORDER BY 1""").fetchall()
    names = [r["proname"] for r in rows]
    assert {"renew_lease_v2", "release_shard_v2", "complete_shard_v2", "mark_in_flight_v2", "abandon_shard_v2",
            "put_results_v3", "fail_records_v3"} <= set(names), names
    for r in rows:
        assert not r["proretset"] and r["outs"] and r["outs"][0] == "stale" and r["first_type"] == "boolean", r

def test_no_migration_or_schema_comment_tells_history():
    """Comments say what the code does now; history lives in git, measurements in docs/."""
    words = ("until now", "issue ", " ms)", "no longer", "used to ")
    for path in sorted((db.sql_dir() / "schema").glob("*.sql")) + db.migrations():
        comments = "\n".join(line.split("--", 1)[1] for line in path.read_text().splitlines() if "--" in line)
        for w in words:
            assert w not in comments.lower(), f"{path.name}: a comment says {w.strip()!r}"


def test_a_job_version_from_before_0023_keeps_working_after_it(empty_db, monkeypatch):
    """Migrations up to 0022, a job version submitted, run and published with that release's
    functions (the key and shard index under the database's collation) and a second one submitted;
    then 0023: the published view still answers, the second version's shard index is rebuilt in
    byte order and a worker of this release finishes it, and it publishes."""
    from batch_inference import ledger, plan
    from batch_inference.publish import publish
    from batch_inference.validate import validate
    from gpu_runner.worker import WorkerConfig, run_worker
    from tests.conftest import make_source, make_spec, tickets

    url = empty_db()
    # Every migration but 0023 (the later ones touch neither the snapshot nor its reads), so this
    # release's validate and publish find their functions.
    before = [p for p in db.migrations() if not p.name.startswith("0023_")]
    old = {"snapshot_attach": "SELECT bi.attach_snapshot_v1(%(job)s);",
           "shard_records": "SELECT * FROM bi.shard_records_v3(%(job)s, %(shard)s, %(epoch)s, %(after)s, %(limit)s);"}

    def q_0022(name: str) -> str:
        return old.get(name) or db.q(name)

    with db.connect(url) as c:
        monkeypatch.setattr(db, "migrations", lambda: before)
        db.migrate(c)
        monkeypatch.setattr(plan, "q", q_0022)
        monkeypatch.setattr(ledger, "q", q_0022)
        make_source(c, tickets(25, start=0))
        first = plan.submit(c, make_spec()).job_version
        assert run_worker(WorkerConfig(job_version=first, db_url=url, wait_for_leases=False)) == 0
        assert validate(c, first)["passed"] and publish(c, first)["to_version"] == first
        second = plan.submit(c, make_spec(prompt={"version": "v2"})).job_version
        monkeypatch.undo()

        assert db.migrate(c) == ["0023_snapshot_byte_order_keys.sql"]
        assert c.execute("SELECT count(*) AS n FROM published.tickets_triage").fetchone()["n"] == 25
        indexes = {r["indexname"]: r["indexdef"] for r in c.execute(
            "SELECT indexname, indexdef FROM pg_indexes WHERE schemaname = 'bi' AND tablename LIKE 'snapshot_rows_%'")}
        assert len(indexes) == 4 and all("text_pattern_ops" in d for n, d in indexes.items() if n.endswith("_shard"))
        assert sum(n.endswith("_pkey") for n in indexes) == 2          # the old partitions keep their key
        assert run_worker(WorkerConfig(job_version=second, db_url=url, wait_for_leases=False)) == 0
        assert validate(c, second)["passed"] and publish(c, second)["to_version"] == second
        assert c.execute("SELECT count(*) AS n FROM published.tickets_triage").fetchone()["n"] == 25
        third = plan.submit(c, make_spec(prompt={"version": "v3"})).job_version   # this release's attach
        names = {r["indexname"] for r in c.execute("SELECT indexname FROM pg_indexes WHERE schemaname = 'bi' "
                                                    "AND tablename LIKE 'snapshot_rows_%'")}
        assert len(names) == 6 and sum(n.endswith("_key") for n in names) == 1 and third
