-- 0026_review_rejections: a reviewer's rejection of a whole version is kept
-- in the ledger (bi.review_rejections: who, why, when; withdrawn with who,
-- when and why). bi.publish_v1 refuses a version with a standing rejection,
-- forced or not, in the statement that switches the pointer, and the review
-- gate (bi.review_gate_problem_v1) is not met while one stands. Never edited.

-- A reviewer's rejection of a whole version (the Required Action's Reject in
-- Airflow, `batch-inference review --reject`), with who, why and when. It
-- stands until withdrawn (who, when, why, beside it): while one stands,
-- bi.publish_v1 refuses the version, forced or not, in the statement that
-- switches the pointer, and its review gate is not met. Goes with its version.
CREATE TABLE IF NOT EXISTS bi.review_rejections (
    id              bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    job_version     text NOT NULL REFERENCES bi.jobs (job_version) ON DELETE CASCADE,
    reviewer        text NOT NULL,      -- 'airflow:NAME' from a Required Action, 'cli:NAME' from the command
    reason          text NOT NULL,
    rejected_at     timestamptz NOT NULL DEFAULT clock_timestamp(),
    withdrawn_by    text,
    withdrawn_at    timestamptz,
    withdraw_reason text,
    CHECK ((withdrawn_by IS NULL) = (withdrawn_at IS NULL) AND (withdrawn_at IS NULL) = (withdraw_reason IS NULL))
);
CREATE INDEX IF NOT EXISTS review_rejections_standing ON bi.review_rejections (job_version)
    WHERE withdrawn_at IS NULL;
REVOKE ALL ON bi.review_rejections FROM PUBLIC;
REVOKE ALL ON SEQUENCE bi.review_rejections_id_seq FROM PUBLIC;

-- Record a rejection of a version. Guard: a reviewer and a reason; the version
-- exists (no_data_found otherwise). The statement takes a key-share lock on the
-- version's bi.jobs row, as bi.record_review_v1 does: a rejection either
-- commits before bi.publish_v1 looks for one (and the publish is refused) or
-- waits until that publish has committed (the version is then published, and
-- the row says so: status). Owner only.
CREATE OR REPLACE FUNCTION bi.record_rejection_v1(p_job text, p_reviewer text, p_reason text)
RETURNS TABLE (id bigint, job_version text, reviewer text, reason text, rejected_at timestamptz, status text)
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
#variable_conflict use_column
BEGIN
    IF nullif(btrim(p_reviewer), '') IS NULL OR nullif(btrim(p_reason), '') IS NULL THEN
        RAISE EXCEPTION 'a rejection needs the reviewer''s name and a reason' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    RETURN QUERY
    WITH jb AS (SELECT j.job_version, j.status FROM bi.jobs j WHERE j.job_version = p_job FOR KEY SHARE),
         ins AS (INSERT INTO bi.review_rejections (job_version, reviewer, reason)
                 SELECT jb.job_version, p_reviewer, btrim(p_reason) FROM jb
                 RETURNING review_rejections.id, review_rejections.job_version, review_rejections.reviewer,
                           review_rejections.reason, review_rejections.rejected_at)
    SELECT ins.id, ins.job_version, ins.reviewer, ins.reason, ins.rejected_at, jb.status FROM ins, jb;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'no job version %', p_job USING ERRCODE = 'no_data_found';
    END IF;
END $$;

-- Withdraw a version's standing rejections, with who and why; returns how many.
-- Guard: an actor and a reason. Owner only.
CREATE OR REPLACE FUNCTION bi.withdraw_rejections_v1(p_job text, p_actor text, p_reason text) RETURNS integer
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    n integer;
BEGIN
    IF nullif(btrim(p_actor), '') IS NULL OR nullif(btrim(p_reason), '') IS NULL THEN
        RAISE EXCEPTION 'withdrawing a rejection needs who and why' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    UPDATE bi.review_rejections rj
       SET withdrawn_by = p_actor, withdrawn_at = clock_timestamp(), withdraw_reason = btrim(p_reason)
     WHERE rj.job_version = p_job AND rj.withdrawn_at IS NULL;
    GET DIAGNOSTICS n = ROW_COUNT;
    RETURN n;
END $$;

-- The version's latest standing rejection, one line, or NULL when none stands.
CREATE OR REPLACE FUNCTION bi.standing_rejection_v1(p_job text) RETURNS text
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT format('rejected by %s at %s: %s', rj.reviewer, to_char(rj.rejected_at AT TIME ZONE 'UTC',
                  'YYYY-MM-DD HH24:MI:SS "UTC"'), rj.reason)
      FROM bi.review_rejections rj
     WHERE rj.job_version = p_job AND rj.withdrawn_at IS NULL
     ORDER BY rj.id DESC LIMIT 1;
$$;

-- Why the version's review gate is not met, one line, or NULL when it is (or
-- the spec asks for no review). A standing rejection fails it whatever the
-- counts say. Unsure verdicts count as reviewed, not right.
CREATE OR REPLACE FUNCTION bi.review_gate_problem_v1(p_job text) RETURNS text
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT CASE
        WHEN bi.standing_rejection_v1(p_job) IS NOT NULL THEN 'review: ' || bi.standing_rejection_v1(p_job)
        WHEN st.required = 0 AND st.min_right = 0 THEN NULL
        WHEN st.reviewed < greatest(st.required, 1)
            THEN format('review: %s of %s required sample rows reviewed', st.reviewed, greatest(st.required, 1))
        WHEN st.right_n::double precision / st.reviewed < st.min_right
            THEN format('review: %s of %s reviewed rows marked right (%s%%), under the gate of %s%%', st.right_n,
                        st.reviewed, round(100.0 * st.right_n / st.reviewed, 1), round(100 * st.min_right::numeric, 1))
    END
      FROM bi.review_state_v1(p_job) st;
$$;

-- bi.publish_v1 as in 0001, with the standing rejection's guard after the
-- dropped version's.
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
