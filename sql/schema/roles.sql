-- roles: least privilege. Who may call what.
--
-- Three kinds of credentials touch this schema:
--
-- * the owner (the role that ran the migrations: Airflow, the CLI, on-call)
--   submits, validates, publishes and reads everything;
-- * a worker logs in as a role that is a member of the NOLOGIN group role
--   bi_worker. It may EXECUTE the ledger functions the worker process calls and
--   nothing else: no table, view or sequence in schema bi, no publish, no
--   drop. Those functions are SECURITY DEFINER (ledger.sql), so they read and
--   write the tables as the owner, behind their state and epoch guards;
-- * a reader is a member of bi_reader: it reads published views and dead
--   letters under row-level security (publish.sql); the dashboard reads as
--   the reader role mapped to the signed-in Airflow user (bi.dashboard_readers).
--
-- On top of that a worker may only work on the job versions it is given: a
-- row in bi.worker_grants names a role (the worker's login role, or any group
-- role it belongs to, bi_worker included) and a job version. Every
-- worker-facing function calls bi.assert_may_work_on_v1 first, so a worker
-- that holds a lease on nothing it was granted cannot read a single snapshot
-- row. tests/test_privileges.py checks that each one does.
--
-- Who is asking: session_user, the role that authenticated. Inside a
-- SECURITY DEFINER function current_user is the owner, and SET ROLE can only
-- move to roles the login role already belongs to, so session_user is the
-- identity that cannot be borrowed. The owner (and a superuser) passes always.

-- Which roles may work on which job version. Written by the owner when it
-- launches workers for a job (bi.grant_job_v1); gone with the job version.
CREATE TABLE IF NOT EXISTS bi.worker_grants (
    role_name   text NOT NULL,
    job_version text NOT NULL REFERENCES bi.jobs (job_version) ON DELETE CASCADE,
    granted_by  text NOT NULL DEFAULT session_user,
    granted_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (role_name, job_version)
);
CREATE INDEX IF NOT EXISTS worker_grants_job ON bi.worker_grants (job_version);

-- True when the authenticated role may work on p_job: it belongs to the
-- schema owner's role (admin, superuser), or to a role granted this job.
CREATE OR REPLACE FUNCTION bi.may_work_on_v1(p_job text) RETURNS boolean
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    SELECT pg_has_role(session_user, (SELECT n.nspowner FROM pg_namespace n WHERE n.nspname = 'bi'), 'MEMBER')
        OR EXISTS (SELECT 1
                     FROM bi.worker_grants g
                     JOIN pg_roles r ON r.rolname = g.role_name
                    WHERE g.job_version = p_job
                      AND pg_has_role(session_user, r.oid, 'MEMBER'));
$$;

CREATE OR REPLACE FUNCTION bi.assert_may_work_on_v1(p_job text) RETURNS void
LANGUAGE plpgsql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF NOT bi.may_work_on_v1(p_job) THEN
        RAISE EXCEPTION 'role % may not work on job version %', session_user, p_job
            USING ERRCODE = 'insufficient_privilege',
                  HINT = 'the owner grants it with SELECT bi.grant_job_v1(role, job_version)';
    END IF;
END $$;

-- Owner-only: give a worker role one job.
CREATE OR REPLACE FUNCTION bi.grant_job_v1(p_role text, p_job text) RETURNS boolean
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = p_role) THEN
        RAISE EXCEPTION 'no role %', p_role USING ERRCODE = 'undefined_object';
    END IF;
    -- A grant to a role outside bi_worker would be useless (it cannot EXECUTE
    -- the ledger) or, for an admin, meaningless; refusing it catches typos.
    IF NOT pg_has_role(p_role, 'bi_worker', 'MEMBER') THEN
        RAISE EXCEPTION 'role % is not a member of bi_worker', p_role USING ERRCODE = 'invalid_grant_operation';
    END IF;
    INSERT INTO bi.worker_grants (role_name, job_version) VALUES (p_role, p_job)
    ON CONFLICT (role_name, job_version) DO NOTHING;
    RETURN FOUND;
END $$;

CREATE OR REPLACE FUNCTION bi.revoke_job_v1(p_role text, p_job text) RETURNS boolean
LANGUAGE sql SET search_path = pg_catalog, pg_temp AS $$
    DELETE FROM bi.worker_grants WHERE role_name = p_role AND job_version = p_job RETURNING true;
$$;

-- Airflow user -> the database role the dashboard reads customer text as:
-- inside a transaction that runs SET LOCAL ROLE to that role, so row-level
-- security decides what it sees. A user with no row reads no customer text
-- at all (counts only). Several Airflow users may share one role. A role
-- that would see past row-level security (a superuser, BYPASSRLS, or a
-- member of the bi schema's owner, which owns the tables) is refused when
-- mapped and again at every read (bi.dashboard_role_problem_v1).
CREATE TABLE IF NOT EXISTS bi.dashboard_readers (
    airflow_user text PRIMARY KEY,   -- BaseUser.get_name(): the name the user signs in with
    role_name    text NOT NULL,      -- a bi_reader member
    mapped_by    text NOT NULL DEFAULT session_user,
    mapped_at    timestamptz NOT NULL DEFAULT clock_timestamp()
);

-- Why a role cannot stand for a dashboard user, or NULL when it can.
CREATE OR REPLACE FUNCTION bi.dashboard_role_problem_v1(p_role text) RETURNS text
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT CASE
        WHEN r.oid IS NULL THEN format('no role %s', p_role)
        WHEN r.rolsuper OR r.rolbypassrls
            THEN format('role %s bypasses row-level security (superuser or BYPASSRLS)', r.rolname)
        WHEN pg_has_role(r.oid, (SELECT n.nspowner FROM pg_namespace n WHERE n.nspname = 'bi'), 'MEMBER')
            THEN format('role %s is a member of the owner of schema bi, which row-level security does not restrict',
                        r.rolname)
        WHEN NOT pg_has_role(r.oid, 'bi_reader', 'MEMBER')
            THEN format('role %s is not a member of bi_reader', r.rolname)
    END
      FROM (SELECT 1) one
      LEFT JOIN pg_roles r ON r.rolname = p_role;
$$;

-- Owner-only: map an Airflow user to a reader role, replacing an earlier mapping.
CREATE OR REPLACE FUNCTION bi.map_dashboard_reader_v1(p_user text, p_role text) RETURNS text
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v_problem text := bi.dashboard_role_problem_v1(p_role);
BEGIN
    IF nullif(btrim(p_user), '') IS NULL THEN
        RAISE EXCEPTION 'name the Airflow user to map' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF v_problem IS NOT NULL THEN
        RAISE EXCEPTION 'cannot map Airflow user % to role %: %', p_user, p_role, v_problem
            USING ERRCODE = 'invalid_grant_operation';
    END IF;
    INSERT INTO bi.dashboard_readers AS m (airflow_user, role_name) VALUES (p_user, p_role)
    ON CONFLICT (airflow_user) DO UPDATE
       SET role_name = excluded.role_name, mapped_by = session_user, mapped_at = clock_timestamp();
    RETURN p_role;
END $$;

CREATE OR REPLACE FUNCTION bi.unmap_dashboard_reader_v1(p_user text) RETURNS boolean
LANGUAGE sql SET search_path = pg_catalog, pg_temp AS $$
    DELETE FROM bi.dashboard_readers WHERE airflow_user = p_user RETURNING true;
$$;

-- Nothing in schema bi for PUBLIC: functions are executable by PUBLIC by
-- default, and a SECURITY DEFINER function callable by anyone with USAGE on
-- bi would be a way around every grant below. Publishing, dropping, granting
-- and mapping are owner's acts: nobody else may even call those functions.
REVOKE ALL ON SCHEMA bi FROM PUBLIC;
REVOKE ALL ON ALL TABLES IN SCHEMA bi FROM PUBLIC;
REVOKE ALL ON ALL SEQUENCES IN SCHEMA bi FROM PUBLIC;
REVOKE EXECUTE ON ALL ROUTINES IN SCHEMA bi FROM PUBLIC;
-- Functions the owner creates in later migrations start closed too. (A
-- per-schema default can only add privileges, so this one is database-wide
-- for the migrating role; grant what a reader or worker needs explicitly.)
ALTER DEFAULT PRIVILEGES REVOKE EXECUTE ON ROUTINES FROM PUBLIC;

-- The worker set: exactly what gpu_runner/worker.py and ledger.py call, and
-- the read-only "may I?" check.
GRANT USAGE ON SCHEMA bi TO bi_worker;
GRANT EXECUTE ON FUNCTION
    bi.claim_shard_v2(text, text, text, integer),
    bi.renew_lease_v2(text, integer, bigint, text, integer),
    bi.release_shard_v2(text, integer, bigint, text),
    bi.complete_shard_v2(text, integer, bigint, text),
    bi.shard_records_v4(text, integer, bigint, text, integer),
    bi.mark_in_flight_v2(text, integer, bigint, text, text[]),
    bi.abandon_shard_v2(text, integer, bigint, text),
    bi.put_results_v3(text, integer, bigint, text, text, text, text, text[], jsonb[], text[]),
    bi.fail_records_v3(text, integer, bigint, text, text, text[], text[], text[], integer[]),
    bi.halt_job_v1(text, text),
    bi.job_spec_v2(text),
    bi.job_counts_v1(text),
    bi.may_work_on_v1(text)
TO bi_worker;

-- The hosted batch transports (hosted.sql): a hosted worker records, confirms,
-- polls and closes its provider batches under its lease.
GRANT EXECUTE ON FUNCTION
    bi.hosted_open_v1(text, integer, bigint, text, text, text[]),
    bi.hosted_intents_v1(text, integer, bigint),
    bi.hosted_update_v1(text, integer, bigint, text, integer, text, text, text, text[], text, integer[], boolean,
                        boolean, bigint, bigint),
    bi.hosted_spend_v1(text, boolean)
TO bi_worker;

-- The model ladder (ladder.sql): a ladder worker records and reads back every rung's answers under its lease.
GRANT EXECUTE ON FUNCTION
    bi.ladder_put_answers_v1(text, integer, bigint, text, text[], integer[], text[], boolean[], double precision[],
                             boolean[], text[]),
    bi.ladder_answers_v1(text, integer, bigint, text[])
TO bi_worker;

-- Embedding jobs (embed.sql): a worker stores results with their vectors under its lease.
GRANT EXECUTE ON FUNCTION
    bi.put_embeddings_v1(text, integer, bigint, text, text, text, text, text[], jsonb[], bytea[])
TO bi_worker;

-- Regions (regions.sql): a worker of a region claims near shards first, reads its shard's replica (and
-- the ledger's rows of it, to rebuild one), hands in its results as a file merged near the ledger, and reports
-- with each renewal the results it holds until then.
GRANT EXECUTE ON FUNCTION
    bi.claim_shard_region_v2(text, text, text, integer, text, boolean),
    bi.region_store_v1(text, text),
    bi.region_shard_state_v1(text, integer, bigint),
    bi.replica_rows_v1(text, integer, bigint),
    bi.replica_rebuilt_v1(text, integer, bigint, text, text, text, bigint, double precision),
    bi.hand_in_results_v1(text, integer, bigint, text, text, text, text, integer, bigint, text, text, text),
    bi.renew_lease_held_v1(text, integer, bigint, text, integer, integer)
TO bi_worker;

-- Identical rendered inputs computed once (counts.sql): a worker counts the records it stored with another's result.
GRANT EXECUTE ON FUNCTION bi.note_shared_v1(text, integer, bigint, text, integer) TO bi_worker;
