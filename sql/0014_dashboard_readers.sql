-- 0014_dashboard_readers: the dashboard reads customer text as the signed-in
-- Airflow user's database role, so row-level security decides what it sees.
--
-- * bi.dead_letters gets the results' ACL rule (0003): a bi_reader member
--   sees a dead letter when its ACL overlaps the reader's principals
--   (bi.current_principals()), or when it has no ACL and its dataset's
--   null_acl is 'all_readers'. Unlike results, a dead letter is visible
--   whether or not its version is published: it is what on-call reads while
--   the night runs. The owner and the ledger's SECURITY DEFINER functions
--   bypass the policy, as on results.
-- * bi.dashboard_readers maps an Airflow user name to a database role. The
--   dashboard looks the signed-in user up there and reads dead letters and
--   validation examples inside a transaction that runs SET LOCAL ROLE to that
--   role; a user with no row reads no customer text at all (counts only).
--   Several Airflow users may share one role (a group role of readers).
-- * A role that would see past row-level security (a superuser, BYPASSRLS,
--   or a member of the bi schema's owner, which owns the tables) is refused
--   when mapped and again at every read (bi.dashboard_role_problem_v1).

ALTER TABLE bi.dead_letters ENABLE ROW LEVEL SECURITY;

-- The job versions whose records without an ACL every reader may see. SECURITY
-- DEFINER: the policy runs as the reader, who has no privilege on bi.jobs.
-- Called once per statement (an uncorrelated sub-select in the policy).
CREATE OR REPLACE FUNCTION bi.null_acl_readable_jobs_v1() RETURNS text[]
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    SELECT coalesce(array_agg(j.job_version), '{}')
      FROM bi.jobs j
      LEFT JOIN bi.dataset_acl a ON a.dataset = j.dataset
     WHERE coalesce(a.null_acl, 'all_readers') = 'all_readers';
$$;

DROP POLICY IF EXISTS dead_letters_acl ON bi.dead_letters;
CREATE POLICY dead_letters_acl ON bi.dead_letters FOR SELECT TO bi_reader
USING (
    CASE WHEN acl IS NULL
         THEN job_version = ANY ((SELECT bi.null_acl_readable_jobs_v1())::text[])
         ELSE acl && (SELECT bi.current_principals())
    END
);

GRANT SELECT ON bi.dead_letters TO bi_reader;
GRANT EXECUTE ON FUNCTION bi.null_acl_readable_jobs_v1() TO bi_reader;


-- Airflow user -> the database role the dashboard reads as.
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

-- Owner-only (no EXECUTE for PUBLIC, 0004's default privileges): map an
-- Airflow user to a reader role, replacing an earlier mapping.
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

REVOKE ALL ON bi.dashboard_readers FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION bi.map_dashboard_reader_v1(text, text) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION bi.unmap_dashboard_reader_v1(text) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION bi.dashboard_role_problem_v1(text) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION bi.null_acl_readable_jobs_v1() FROM PUBLIC;
