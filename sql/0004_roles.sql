-- 0004_roles: least privilege for GPU workers.
--
-- Two kinds of credentials touch this schema:
--
-- * the owner (the role that ran the migrations: Airflow, the CLI, on-call)
--   submits, validates, publishes and reads everything;
-- * a worker logs in as a role that is a member of the NOLOGIN group role
--   bi_worker. It may EXECUTE the ledger functions the worker process calls and
--   nothing else: no table, view or sequence in schema bi, no publish, no
--   drop. Those functions are SECURITY DEFINER (0002), so they read and write
--   the tables as the owner, behind their state and epoch guards.
--
-- On top of that a worker may only work on the job versions it is given: a
-- row in bi.worker_grants names a role (the worker's login role, or any group
-- role it belongs to, bi_worker included) and a job version. A worker that
-- holds a lease on nothing it was granted cannot read a single snapshot row.
--
-- How the per-job guard is attached without copying 0002's bodies: each
-- worker-facing function is renamed to <name>_unguarded and a thin wrapper
-- with the original name and signature checks the grant, then calls it. The
-- transition logic stays in 0002 only (a fix there is never shadowed by a
-- stale copy here), and sql/queries.sql and the worker are unchanged. A later
-- migration that CREATE OR REPLACEs one of these names replaces the guard
-- too: tests/test_privileges.py fails if that happens.
--
-- Who is asking: session_user, the role that authenticated. Inside a
-- SECURITY DEFINER function current_user is the owner, and SET ROLE can only
-- move to roles the login role already belongs to, so session_user is the
-- identity that cannot be borrowed. The owner (and a superuser) passes always.

-- Roles are cluster-wide; the migration runs once per database.
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'bi_worker') THEN
        CREATE ROLE bi_worker NOLOGIN;
    END IF;
END $$;

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

-- Owner-only (no EXECUTE for PUBLIC or bi_worker): give a worker role one job.
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

-- The worker-facing functions: rename the 0002 bodies, wrap them with the guard.
ALTER FUNCTION bi.claim_shard_v1(text, text, text, integer) RENAME TO claim_shard_v1_unguarded;
ALTER FUNCTION bi.renew_lease_v1(text, integer, bigint, text, integer) RENAME TO renew_lease_v1_unguarded;
ALTER FUNCTION bi.release_shard_v1(text, integer, bigint, text) RENAME TO release_shard_v1_unguarded;
ALTER FUNCTION bi.complete_shard_v1(text, integer, bigint, text) RENAME TO complete_shard_v1_unguarded;
ALTER FUNCTION bi.shard_records_v1(text, integer, bigint) RENAME TO shard_records_v1_unguarded;
ALTER FUNCTION bi.put_results_v1(text, integer, bigint, text, text, text[], jsonb[], text[])
    RENAME TO put_results_v1_unguarded;
ALTER FUNCTION bi.fail_records_v1(text, integer, bigint, text, text, text[], text[], text[])
    RENAME TO fail_records_v1_unguarded;
ALTER FUNCTION bi.job_spec_v1(text) RENAME TO job_spec_v1_unguarded;
ALTER FUNCTION bi.job_counts_v1(text) RENAME TO job_counts_v1_unguarded;

CREATE FUNCTION bi.claim_shard_v1(p_job text, p_owner text, p_transport text DEFAULT 'batch',
                                  p_lease_seconds integer DEFAULT NULL)
RETURNS TABLE (shard_no integer, epoch bigint, lease_expires_at timestamptz, records integer)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM bi.assert_may_work_on_v1(p_job);
    RETURN QUERY SELECT * FROM bi.claim_shard_v1_unguarded(p_job, p_owner, p_transport, p_lease_seconds);
END $$;

CREATE FUNCTION bi.renew_lease_v1(p_job text, p_shard integer, p_epoch bigint, p_worker text,
                                  p_lease_seconds integer DEFAULT NULL)
RETURNS TABLE (ok boolean, mode text, lease_expires_at timestamptz)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM bi.assert_may_work_on_v1(p_job);
    RETURN QUERY SELECT * FROM bi.renew_lease_v1_unguarded(p_job, p_shard, p_epoch, p_worker, p_lease_seconds);
END $$;

CREATE FUNCTION bi.release_shard_v1(p_job text, p_shard integer, p_epoch bigint, p_worker text)
RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM bi.assert_may_work_on_v1(p_job);
    RETURN bi.release_shard_v1_unguarded(p_job, p_shard, p_epoch, p_worker);
END $$;

CREATE FUNCTION bi.complete_shard_v1(p_job text, p_shard integer, p_epoch bigint, p_worker text)
RETURNS text
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM bi.assert_may_work_on_v1(p_job);
    RETURN bi.complete_shard_v1_unguarded(p_job, p_shard, p_epoch, p_worker);
END $$;

CREATE FUNCTION bi.shard_records_v1(p_job text, p_shard integer, p_epoch bigint)
RETURNS TABLE (record_id text, text text, attempts integer)
LANGUAGE plpgsql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM bi.assert_may_work_on_v1(p_job);
    RETURN QUERY SELECT * FROM bi.shard_records_v1_unguarded(p_job, p_shard, p_epoch);
END $$;

CREATE FUNCTION bi.put_results_v1(p_job text, p_shard integer, p_epoch bigint, p_worker text, p_transport text,
                                  p_ids text[], p_outputs jsonb[], p_categories text[])
RETURNS integer
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM bi.assert_may_work_on_v1(p_job);
    RETURN bi.put_results_v1_unguarded(p_job, p_shard, p_epoch, p_worker, p_transport,
                                       p_ids, p_outputs, p_categories);
END $$;

CREATE FUNCTION bi.fail_records_v1(p_job text, p_shard integer, p_epoch bigint, p_worker text, p_transport text,
                                   p_ids text[], p_errors text[], p_outputs text[])
RETURNS TABLE (record_id text, attempts integer, dead boolean)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM bi.assert_may_work_on_v1(p_job);
    RETURN QUERY SELECT * FROM bi.fail_records_v1_unguarded(p_job, p_shard, p_epoch, p_worker, p_transport,
                                                             p_ids, p_errors, p_outputs);
END $$;

CREATE FUNCTION bi.job_spec_v1(p_job text)
RETURNS TABLE (spec jsonb, mode text, status text)
LANGUAGE plpgsql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM bi.assert_may_work_on_v1(p_job);
    RETURN QUERY SELECT * FROM bi.job_spec_v1_unguarded(p_job);
END $$;

CREATE FUNCTION bi.job_counts_v1(p_job text)
RETURNS TABLE (records bigint, stored bigint, stored_batch bigint, stored_fallback bigint, reused bigint,
               dead_letters bigint, outstanding bigint, shards_pending bigint, shards_leased bigint,
               shards_done bigint, mode text, status text, first_claim_at timestamptz)
LANGUAGE plpgsql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM bi.assert_may_work_on_v1(p_job);
    RETURN QUERY SELECT * FROM bi.job_counts_v1_unguarded(p_job);
END $$;

-- Nothing in schema bi for PUBLIC: functions are executable by PUBLIC by
-- default, and a SECURITY DEFINER function callable by anyone with USAGE on
-- bi would be a way around every grant below.
REVOKE ALL ON SCHEMA bi FROM PUBLIC;
REVOKE ALL ON ALL TABLES IN SCHEMA bi FROM PUBLIC;
REVOKE ALL ON ALL SEQUENCES IN SCHEMA bi FROM PUBLIC;
REVOKE EXECUTE ON ALL ROUTINES IN SCHEMA bi FROM PUBLIC;
-- Functions the owner creates in later migrations start closed too. (A
-- per-schema default can only add privileges, so this one is database-wide
-- for the migrating role; grant what a reader or worker needs explicitly.)
ALTER DEFAULT PRIVILEGES REVOKE EXECUTE ON ROUTINES FROM PUBLIC;

-- The worker set: exactly what gpu_runner/worker.py and ledger.py call.
GRANT USAGE ON SCHEMA bi TO bi_worker;
GRANT EXECUTE ON FUNCTION
    bi.claim_shard_v1(text, text, text, integer),
    bi.renew_lease_v1(text, integer, bigint, text, integer),
    bi.release_shard_v1(text, integer, bigint, text),
    bi.complete_shard_v1(text, integer, bigint, text),
    bi.shard_records_v1(text, integer, bigint),
    bi.put_results_v1(text, integer, bigint, text, text, text[], jsonb[], text[]),
    bi.fail_records_v1(text, integer, bigint, text, text, text[], text[], text[]),
    bi.job_spec_v1(text),
    bi.job_counts_v1(text),
    bi.may_work_on_v1(text)
TO bi_worker;
