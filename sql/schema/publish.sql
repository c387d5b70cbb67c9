-- publish: validation results, the published views, publish and rollback,
-- and row-level access control for readers.
--
-- Downstream reads one stable view per dataset, published.<dataset>, which
-- joins bi.results to the dataset's row in bi.publish_pointer. Publishing or
-- rolling back is one UPDATE of that row: readers never wait on a lock and a
-- statement sees exactly one version (one snapshot reads both the pointer and
-- the rows). The view itself is created once, at the first publish; no DDL
-- runs on the switch.
--
-- State changes are SQL functions with the guard in the statement. Unlike the
-- ledger functions they are SECURITY INVOKER: the caller must own the tables
-- (the admin or migrating role), so a reader or a worker that can EXECUTE
-- them still cannot publish. That also keeps current_user as the default
-- actor. Nobody but the owner may execute them (roles.sql closes schema bi to
-- PUBLIC).

-- One row per published view (created at the dataset's first publish).
CREATE TABLE IF NOT EXISTS bi.published_views (
    dataset     text PRIMARY KEY,
    view_name   text NOT NULL,          -- qualified and quoted, e.g. published.tickets_triage
    fields      jsonb NOT NULL,         -- the view's shape: {"record_id": type, "field": type, ...}
    created_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
    created_by  text NOT NULL DEFAULT current_user
);

-- What a publish or rollback left each destination pointing at: for an
-- Iceberg table the snapshot its main branch names and the metadata file that
-- commit wrote. Written in the transaction that switches the view, so a
-- history row and its destinations appear together. No credentials: the
-- destination is named by kind, catalog name and table.
CREATE TABLE IF NOT EXISTS bi.publish_destinations (
    history_id  bigint NOT NULL REFERENCES bi.publish_history (id) ON DELETE CASCADE,
    destination text NOT NULL,              -- e.g. iceberg:ledger.analytics.ticket_triage
    job_version text NOT NULL,
    snapshot_id bigint,
    location    text,
    PRIMARY KEY (history_id, destination)
);
REVOKE ALL ON bi.publish_destinations FROM PUBLIC;

-- pyiceberg's SqlCatalog creates its own two tables (iceberg_tables,
-- iceberg_namespace_properties) here on first use.
CREATE SCHEMA IF NOT EXISTS iceberg_catalog;
REVOKE ALL ON SCHEMA iceberg_catalog FROM PUBLIC;

-- Principal mapping. A reader's principals are its own role name, the names of
-- the roles whose privileges it has (pg_has_role USAGE: inherited membership),
-- and every principal mapped here to any of those roles. A source's ACL
-- entries rarely are PostgreSQL role names ('team:billing', an LDAP group), so
-- this table says which database role stands for which ACL entry.
CREATE TABLE IF NOT EXISTS bi.reader_principals (
    role      text NOT NULL,   -- a database role: a reader or a group readers belong to
    principal text NOT NULL,   -- an ACL entry as the source writes it
    PRIMARY KEY (role, principal)
);

-- What a record without an ACL (acl IS NULL) means, per dataset. Absent row:
-- 'all_readers', i.e. every member of bi_reader sees it. An empty ACL ('{}')
-- overlaps nothing and is visible to no reader, whatever this says.
CREATE TABLE IF NOT EXISTS bi.dataset_acl (
    dataset  text PRIMARY KEY,
    null_acl text NOT NULL DEFAULT 'all_readers' CHECK (null_acl IN ('all_readers', 'nobody'))
);

-- SECURITY INVOKER on purpose: current_user must be the reader, not the owner.
-- Called once per statement from the policy (as an uncorrelated sub-select,
-- so it is an InitPlan, not a per-row call).
CREATE OR REPLACE FUNCTION bi.current_principals() RETURNS text[]
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $$
    WITH held AS (
        SELECT r.rolname::text AS name FROM pg_roles r
         WHERE pg_has_role(current_user, r.oid, 'USAGE')
    )
    SELECT coalesce(array_agg(DISTINCT p), '{}') FROM (
        SELECT name AS p FROM held
        UNION ALL
        SELECT m.principal FROM bi.reader_principals m JOIN held ON held.name = m.role
    ) t;
$$;

-- Row-level security on results. The owner (the migrating role) and
-- superusers bypass it, and so do the ledger's SECURITY DEFINER functions,
-- which run as their owner: workers keep writing. Any other role sees no row
-- unless a policy admits it, and only bi_reader has a policy: a reader sees a
-- row only if its version is published somewhere (never a half-finished or
-- superseded version, even reading bi.results directly) and its ACL overlaps
-- the reader's principals, or it has no ACL and the dataset's null_acl says so.
ALTER TABLE bi.results ENABLE ROW LEVEL SECURITY;

DROP POLICY IF EXISTS results_published_acl ON bi.results;
CREATE POLICY results_published_acl ON bi.results FOR SELECT TO bi_reader
USING (
    CASE WHEN acl IS NULL
         THEN job_version IN (SELECT p.job_version FROM bi.publish_pointer p
                                LEFT JOIN bi.dataset_acl a ON a.dataset = p.dataset
                               WHERE coalesce(a.null_acl, 'all_readers') = 'all_readers')
         ELSE job_version IN (SELECT p.job_version FROM bi.publish_pointer p)
              AND acl && (SELECT bi.current_principals())
    END
);

-- The mapping is readable by readers (the policy runs as them), but each sees
-- only the rows of roles it holds.
ALTER TABLE bi.reader_principals ENABLE ROW LEVEL SECURITY;
DROP POLICY IF EXISTS reader_principals_own ON bi.reader_principals;
CREATE POLICY reader_principals_own ON bi.reader_principals FOR SELECT TO bi_reader
USING (role IN (SELECT r.rolname FROM pg_roles r WHERE pg_has_role(current_user, r.oid, 'USAGE')));

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

-- One rule for what is read before a version is published: dead letters (what
-- on-call reads while the night runs), their counts per ACL (counts.sql, so a
-- reader counts exactly the dead letters it may read) and the review sample
-- (evaluation.sql, which a reviewer reads before publish). It is the results'
-- ACL rule without "published somewhere": a row with an ACL is visible to a
-- reader holding one of its principals, a row without one as its dataset's
-- null_acl says. The dashboard reads them as the signed-in user's reader role
-- (bi.dashboard_readers, roles.sql). Policy <table>_acl on each table.
DO $rule$
DECLARE
    t text;
BEGIN
    FOREACH t IN ARRAY ARRAY['dead_letters', 'dead_letter_counts', 'review_sample'] LOOP
        EXECUTE format('ALTER TABLE bi.%I ENABLE ROW LEVEL SECURITY', t);
        EXECUTE format('DROP POLICY IF EXISTS %I ON bi.%I', t || '_acl', t);
        EXECUTE format($policy$
            CREATE POLICY %I ON bi.%I FOR SELECT TO bi_reader
            USING (
                CASE WHEN acl IS NULL
                     THEN job_version = ANY ((SELECT bi.null_acl_readable_jobs_v1())::text[])
                     ELSE acl && (SELECT bi.current_principals())
                END
            )$policy$, t || '_acl', t);
    END LOOP;
END $rule$;
GRANT SELECT ON bi.dead_letter_counts TO bi_reader;

-- The views are security_invoker, so the reader needs the base privileges;
-- RLS above narrows them to the rows it may see.
GRANT USAGE ON SCHEMA bi TO bi_reader;
GRANT USAGE ON SCHEMA published TO bi_reader;
GRANT SELECT ON bi.results, bi.dead_letters, bi.publish_pointer, bi.dataset_acl, bi.reader_principals,
    bi.published_views TO bi_reader;
GRANT EXECUTE ON FUNCTION bi.current_principals(), bi.null_acl_readable_jobs_v1() TO bi_reader;

-- A verdict's comment may quote the record: readable with the row it is on.
ALTER TABLE bi.reviews ENABLE ROW LEVEL SECURITY;
DROP POLICY IF EXISTS reviews_of_visible_rows ON bi.reviews;
CREATE POLICY reviews_of_visible_rows ON bi.reviews FOR SELECT TO bi_reader
USING (EXISTS (SELECT 1 FROM bi.review_sample s
                WHERE s.job_version = reviews.job_version AND s.record_id = reviews.record_id));
GRANT SELECT ON bi.review_sample, bi.reviews TO bi_reader;


-- Store a validation report. Guard: every shard done and the version not
-- dropped. A published version keeps its status (the pointer names it);
-- otherwise the status becomes validated or failed_validation. Returns the
-- status, or nothing when the guard refused.
CREATE OR REPLACE FUNCTION bi.record_validation_v1(p_job text, p_report jsonb, p_passed boolean)
RETURNS text
LANGUAGE sql SET search_path = pg_catalog, pg_temp AS $$
    UPDATE bi.jobs j
       SET validation = p_report,
           status = CASE WHEN j.status = 'published' THEN j.status
                         WHEN p_passed THEN 'validated' ELSE 'failed_validation' END
     WHERE j.job_version = p_job
       AND j.status <> 'dropped'
       AND NOT EXISTS (SELECT 1 FROM bi.shards s WHERE s.job_version = p_job AND s.state <> 'done')
    RETURNING j.status;
$$;


-- The view of one dataset, shaped like the version it shows: the output's
-- top-level fields typed from that version's output schema (p_columns, an
-- array of [name, type] in the schema's order; types: text, bigint, double
-- precision, boolean, jsonb), and record_id as the source's id type (text,
-- bigint or uuid), each cast from outputs the worker validated against that
-- schema. Created at the first publish; when the pointer moves to a version
-- of another shape (a field added, a type changed, by a publish or a
-- rollback) it is dropped and created again in the same transaction as the
-- switch, so a reader sees the old version in the old shape or the new one
-- in the new shape. Same shape: no DDL, no lock. Every field stays in
-- `output`. bi.published_views.fields records the shape.
CREATE OR REPLACE FUNCTION bi.ensure_published_view_v2(p_dataset text, p_id_type text, p_columns jsonb)
RETURNS text
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v_name text := format('published.%I', p_dataset);
    fixed text[] := ARRAY['record_id', 'output', 'category', 'model_name', 'model_digest', 'prompt_version',
                          'transport', 'job_version', 'created_at', 'acl'];
    cols text := '';
    fields jsonb := jsonb_build_object('record_id', p_id_type);
    c jsonb;
    f text;
    t text;
BEGIN
    IF p_id_type NOT IN ('text', 'bigint', 'uuid') THEN
        RAISE EXCEPTION 'record_id type % is not one of text, bigint, uuid', p_id_type
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    FOR c IN SELECT * FROM jsonb_array_elements(coalesce(p_columns, '[]')) LOOP
        f := c ->> 0;
        t := c ->> 1;
        CONTINUE WHEN f = ANY (fixed) OR fields ? f OR length(f) > 63;
        cols := cols || CASE t
            WHEN 'text' THEN format(', r.output ->> %L AS %I', f, f)
            WHEN 'bigint' THEN format(', (r.output ->> %L)::numeric::bigint AS %I', f, f)
            WHEN 'double precision' THEN format(', (r.output ->> %L)::double precision AS %I', f, f)
            WHEN 'boolean' THEN format(', (r.output ->> %L)::boolean AS %I', f, f)
            WHEN 'jsonb' THEN format(', r.output -> %L AS %I', f, f)
        END;
        IF cols IS NULL THEN
            RAISE EXCEPTION 'output field %: type % is not one of text, bigint, double precision, boolean, jsonb',
                f, t USING ERRCODE = 'invalid_parameter_value';
        END IF;
        fields := fields || jsonb_build_object(f, t);
    END LOOP;
    IF to_regclass(v_name) IS NOT NULL
       AND (SELECT pv.fields FROM bi.published_views pv WHERE pv.dataset = p_dataset) = fields THEN
        RETURN v_name;
    END IF;
    EXECUTE format('DROP VIEW IF EXISTS %s', v_name);
    -- security_invoker: the policy on bi.results is checked against the
    -- reader, not the view's owner (who bypasses RLS).
    EXECUTE format(
        'CREATE VIEW published.%I WITH (security_invoker = true) AS '
        'SELECT r.record_id%s AS record_id, r.output, r.category%s, r.model_name, r.model_digest, '
        'r.prompt_version, r.transport, r.job_version, r.created_at, r.acl '
        'FROM bi.results r '
        'WHERE r.job_version = (SELECT p.job_version FROM bi.publish_pointer p WHERE p.dataset = %L)',
        p_dataset, CASE p_id_type WHEN 'text' THEN '' ELSE '::' || p_id_type END, cols, p_dataset);
    EXECUTE format('REVOKE ALL ON %s FROM PUBLIC', v_name);
    EXECUTE format('GRANT SELECT ON %s TO bi_reader', v_name);
    EXECUTE format('COMMENT ON VIEW %s IS %L', v_name,
                   format('Published results of dataset %s: the version named in bi.publish_pointer. '
                          'Rows are filtered by ACL for bi_reader members.', p_dataset));
    INSERT INTO bi.published_views AS pv (dataset, view_name, fields) VALUES (p_dataset, v_name, fields)
    ON CONFLICT (dataset) DO UPDATE SET fields = excluded.fields;
    RETURN v_name;
END $$;


-- The status a version returns to when it stops being the published one: what
-- its last validation said (a forced publish of a failed or never-validated
-- version must not come back as 'validated').
CREATE OR REPLACE FUNCTION bi.unpublished_status_v1(p_validation jsonb) RETURNS text
LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE WHEN (p_validation ->> 'passed')::boolean IS TRUE THEN 'validated' ELSE 'failed_validation' END;
$$;


-- Publish: switch the dataset's pointer to p_job and record it, in one
-- transaction. Refused (SQLSTATE 55000, one line) when the version belongs to
-- another dataset, is dropped, still has shards to do, or is not validated and
-- not forced with a reason. Publishing the version already published is a
-- no-op (an Airflow retry must not write history twice). The version's
-- bi.jobs row stays locked FOR UPDATE from before the review gate check to
-- the commit; bi.record_review_v1 takes a key-share lock on the same row, so
-- the check sees every verdict committed before it and a verdict that comes
-- later waits for the switch.
CREATE OR REPLACE FUNCTION bi.publish_v1(p_dataset text, p_job text, p_actor text DEFAULT NULL,
                                        p_force boolean DEFAULT false, p_reason text DEFAULT NULL)
RETURNS TABLE (dataset text, from_version text, to_version text, action text, forced boolean,
               changed boolean, history_id bigint)
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
#variable_conflict use_column
DECLARE
    j record;
    v_from text;
    v_open bigint;
    v_id bigint;
    v_actor text := coalesce(nullif(btrim(p_actor), ''), current_user);
    v_reason text := nullif(btrim(p_reason), '');
    v_review text;
    v_rejected text;
    v_forced boolean;
BEGIN
    -- One publisher per dataset at a time, including the very first publish
    -- (no pointer row to lock yet).
    PERFORM pg_advisory_xact_lock(hashtextextended('bi.publish:' || p_dataset, 0));
    SELECT jb.job_version, jb.dataset, jb.status, jb.validation INTO j
      FROM bi.jobs jb WHERE jb.job_version = p_job FOR UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'no job version %', p_job USING ERRCODE = 'no_data_found';
    END IF;
    IF j.dataset <> p_dataset THEN
        RAISE EXCEPTION 'job version % belongs to dataset %, not %', p_job, j.dataset, p_dataset
            USING ERRCODE = 'object_not_in_prerequisite_state';
    END IF;
    SELECT p.job_version INTO v_from FROM bi.publish_pointer p WHERE p.dataset = p_dataset FOR UPDATE;
    IF v_from = p_job THEN
        RETURN QUERY SELECT p_dataset, v_from, p_job, 'publish'::text, false, false, NULL::bigint;
        RETURN;
    END IF;
    IF j.status = 'dropped' THEN
        RAISE EXCEPTION 'job version % was dropped and cannot be published', p_job
            USING ERRCODE = 'object_not_in_prerequisite_state';
    END IF;
    -- A reviewer's standing rejection (evaluation.sql) is never forcible: it is
    -- withdrawn, with who and why, or the version stays unpublished. Read after
    -- the FOR UPDATE above, which a rejection's key-share lock waits on.
    v_rejected := bi.standing_rejection_v1(p_job);
    IF v_rejected IS NOT NULL THEN
        RAISE EXCEPTION 'job version % was %; refused, even forced (withdraw it: batch-inference review % --withdraw-rejection --reason TEXT)',
            p_job, v_rejected, p_job
            USING ERRCODE = 'object_not_in_prerequisite_state';
    END IF;
    SELECT count(*) INTO v_open FROM bi.shards s WHERE s.job_version = p_job AND s.state <> 'done';
    IF v_open > 0 THEN
        -- Never forcible: it would publish half a job (I3).
        RAISE EXCEPTION 'job version % is not finished (% shard(s) not done); it cannot be published, even forced',
            p_job, v_open USING ERRCODE = 'object_not_in_prerequisite_state';
    END IF;
    IF j.status <> 'validated' AND NOT p_force THEN
        RAISE EXCEPTION 'job version % %: refused (publish --force --reason TEXT to override)',
            p_job, CASE j.status WHEN 'failed_validation' THEN 'failed validation'
                                 WHEN 'running' THEN 'has not been validated'
                                 ELSE 'is ' || j.status || ', not validated' END
            USING ERRCODE = 'object_not_in_prerequisite_state';
    END IF;
    -- The human review gate (evaluation.sql): reviews come after validation,
    -- so it is checked here, in the switching transaction, not in the report.
    v_review := bi.review_gate_problem_v1(p_job);
    IF v_review IS NOT NULL AND NOT p_force THEN
        RAISE EXCEPTION 'job version %: %; refused (publish --force --reason TEXT to override)', p_job, v_review
            USING ERRCODE = 'object_not_in_prerequisite_state';
    END IF;
    IF p_force AND v_reason IS NULL THEN
        RAISE EXCEPTION 'a forced publish needs a reason' USING ERRCODE = 'object_not_in_prerequisite_state';
    END IF;
    v_forced := p_force AND (j.status <> 'validated' OR v_review IS NOT NULL);

    INSERT INTO bi.publish_pointer AS pp (dataset, job_version, switched_at, switched_by)
    VALUES (p_dataset, p_job, clock_timestamp(), v_actor)
    ON CONFLICT ON CONSTRAINT publish_pointer_pkey DO UPDATE
       SET job_version = excluded.job_version, switched_at = excluded.switched_at,
           switched_by = excluded.switched_by;
    UPDATE bi.jobs jb SET status = 'published' WHERE jb.job_version = p_job;
    UPDATE bi.jobs jb SET status = bi.unpublished_status_v1(jb.validation)
     WHERE jb.job_version = v_from AND jb.status = 'published';
    INSERT INTO bi.publish_history (dataset, from_version, to_version, action, forced, reason, actor)
    VALUES (p_dataset, v_from, p_job, 'publish', v_forced, v_reason, v_actor)
    RETURNING id INTO v_id;
    RETURN QUERY SELECT p_dataset, v_from, p_job, 'publish'::text, v_forced, true, v_id;
END $$;


-- Rollback: switch the pointer back to the version the current one replaced
-- (from_version of the latest publish that made the current version live).
-- Repeated rollbacks walk back through the publishes, like an undo stack.
CREATE OR REPLACE FUNCTION bi.rollback_v1(p_dataset text, p_actor text DEFAULT NULL, p_reason text DEFAULT NULL)
RETURNS TABLE (dataset text, from_version text, to_version text, action text, forced boolean,
               changed boolean, history_id bigint)
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
#variable_conflict use_column
DECLARE
    v_cur text;
    v_to text;
    v_id bigint;
    v_actor text := coalesce(nullif(btrim(p_actor), ''), current_user);
BEGIN
    PERFORM pg_advisory_xact_lock(hashtextextended('bi.publish:' || p_dataset, 0));
    SELECT p.job_version INTO v_cur FROM bi.publish_pointer p WHERE p.dataset = p_dataset FOR UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'dataset % has never been published; nothing to roll back', p_dataset
            USING ERRCODE = 'object_not_in_prerequisite_state';
    END IF;
    SELECT h.from_version INTO v_to FROM bi.publish_history h
     WHERE h.dataset = p_dataset AND h.action = 'publish' AND h.to_version = v_cur
     ORDER BY h.id DESC LIMIT 1;
    IF v_to IS NULL THEN
        RAISE EXCEPTION 'nothing to roll back to: % was the first version published for dataset %', v_cur, p_dataset
            USING ERRCODE = 'object_not_in_prerequisite_state';
    END IF;
    IF NOT EXISTS (SELECT 1 FROM bi.jobs jb WHERE jb.job_version = v_to AND jb.status <> 'dropped') THEN
        RAISE EXCEPTION 'cannot roll back dataset % to %: that version was dropped', p_dataset, v_to
            USING ERRCODE = 'object_not_in_prerequisite_state';
    END IF;
    UPDATE bi.publish_pointer p SET job_version = v_to, switched_at = clock_timestamp(), switched_by = v_actor
     WHERE p.dataset = p_dataset;
    UPDATE bi.jobs jb SET status = 'published' WHERE jb.job_version = v_to;
    UPDATE bi.jobs jb SET status = bi.unpublished_status_v1(jb.validation)
     WHERE jb.job_version = v_cur AND jb.status = 'published';
    INSERT INTO bi.publish_history (dataset, from_version, to_version, action, forced, reason, actor)
    VALUES (p_dataset, v_cur, v_to, 'rollback', false, nullif(btrim(p_reason), ''), v_actor)
    RETURNING id INTO v_id;
    RETURN QUERY SELECT p_dataset, v_cur, v_to, 'rollback'::text, false, true, v_id;
END $$;


-- What a record without an ACL means for one dataset's readers.
CREATE OR REPLACE FUNCTION bi.set_null_acl_v1(p_dataset text, p_mode text) RETURNS text
LANGUAGE sql SET search_path = pg_catalog, pg_temp AS $$
    INSERT INTO bi.dataset_acl (dataset, null_acl) VALUES (p_dataset, p_mode)
    ON CONFLICT (dataset) DO UPDATE SET null_acl = excluded.null_acl
    RETURNING null_acl;
$$;


-- Publish and roll back only from the version the caller saw. A person
-- deciding to roll back (the dashboard's button, `rollback --expect`) looked
-- at the dataset's pointer first; if another publish lands between that look
-- and the switch, an unguarded rollback would undo the newer publish instead
-- of the one they meant. The _v2 functions check under the dataset's publish
-- lock, then call the _v1 switch in the same transaction (advisory locks and
-- row locks are re-entrant for their holder), so the switch and its other
-- guards exist once. _v1 serves callers with no expectation (`rollback`
-- without --expect, Airflow). Refusal: SQLSTATE BI409 ("the pointer moved"),
-- one line naming the dataset, the version expected and the version actually
-- published; the DETAIL is the actual version alone, for programs.

-- Raise unless the dataset's pointer is at p_expected (NULL: nothing published
-- yet) or at p_or_at. Takes the publish lock and locks the pointer row until
-- the caller's transaction ends, so what it checked is what the caller then
-- switches.
CREATE OR REPLACE FUNCTION bi.assert_pointer_at_v1(p_dataset text, p_expected text, p_action text,
                                                   p_or_at text DEFAULT NULL)
RETURNS void
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v_cur text;
BEGIN
    PERFORM pg_advisory_xact_lock(hashtextextended('bi.publish:' || p_dataset, 0));
    SELECT p.job_version INTO v_cur FROM bi.publish_pointer p WHERE p.dataset = p_dataset FOR UPDATE;
    IF v_cur IS DISTINCT FROM p_expected AND v_cur IS DISTINCT FROM coalesce(p_or_at, p_expected) THEN
        RAISE EXCEPTION '% of dataset % refused: expected % to be published, but % is; nothing was changed',
            p_action, p_dataset, coalesce(p_expected, 'nothing'), coalesce(v_cur, 'nothing')
            USING ERRCODE = 'BI409', DETAIL = coalesce(v_cur, ''),
                  HINT = 'someone published or rolled back in between: look again and decide again';
    END IF;
END $$;


-- Rollback from p_expected_current: bi.rollback_v1's switch (to the version
-- the current one replaced, with its guards and history row), refused with
-- BI409 when the pointer is not at p_expected_current.
CREATE OR REPLACE FUNCTION bi.rollback_v2(p_dataset text, p_expected_current text, p_actor text DEFAULT NULL,
                                         p_reason text DEFAULT NULL)
RETURNS TABLE (dataset text, from_version text, to_version text, action text, forced boolean,
               changed boolean, history_id bigint)
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM bi.assert_pointer_at_v1(p_dataset, p_expected_current, 'rollback');
    RETURN QUERY SELECT * FROM bi.rollback_v1(p_dataset, p_actor, p_reason);
END $$;


-- Publish p_job in place of p_expected_current (NULL: the dataset's first
-- publish). bi.publish_v1's switch and guards; refused with BI409 when the
-- pointer is elsewhere. Already at p_job is the same no-op as in _v1 (a retry
-- of a publish that committed finds its own version, not the one it expected).
CREATE OR REPLACE FUNCTION bi.publish_v2(p_dataset text, p_job text, p_expected_current text,
                                        p_actor text DEFAULT NULL, p_force boolean DEFAULT false,
                                        p_reason text DEFAULT NULL)
RETURNS TABLE (dataset text, from_version text, to_version text, action text, forced boolean,
               changed boolean, history_id bigint)
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM bi.assert_pointer_at_v1(p_dataset, p_expected_current, 'publish of ' || p_job, p_job);
    RETURN QUERY SELECT * FROM bi.publish_v1(p_dataset, p_job, p_actor, p_force, p_reason);
END $$;
