-- 0004: evaluation in the publish gate. The review sample and the human
-- verdicts on it (sql/schema/evaluation.sql), readers' row-level security on
-- both, and bi.publish_v1 refusing, unless forced with a reason, while the
-- version's review gate is not met (sql/schema/publish.sql).

-- evaluation: the review sample of a job version and the human verdicts on it.
--
-- validate stores the seeded sample here (bi.review_sample, the rows the
-- evaluation suite and reviewers look at, input text beside output); a
-- reviewer's verdict on a row is one row of bi.reviews, replaced when the row
-- is reviewed again, with who said it. The review gate (the spec's
-- evaluation.review) is computed by bi.review_gate_problem_v1 and checked by
-- bi.publish_v1 in the statement that switches the pointer. Readers see the
-- sample through row-level security (publish.sql), as they see dead letters.
-- Both tables go with their job version (ON DELETE CASCADE from bi.jobs).

CREATE TABLE IF NOT EXISTS bi.review_sample (
    job_version text NOT NULL REFERENCES bi.jobs (job_version) ON DELETE CASCADE,
    record_id   text NOT NULL,
    text        text NOT NULL,
    output      jsonb NOT NULL,
    acl         text[],
    PRIMARY KEY (job_version, record_id)
);

CREATE TABLE IF NOT EXISTS bi.reviews (
    job_version text NOT NULL,
    record_id   text NOT NULL,
    verdict     text NOT NULL CHECK (verdict IN ('right', 'wrong', 'unsure')),
    comment     text,
    reviewer    text NOT NULL,          -- 'airflow:NAME' from the dashboard, 'cli:NAME' from the command
    reviewed_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (job_version, record_id),
    FOREIGN KEY (job_version, record_id) REFERENCES bi.review_sample (job_version, record_id) ON DELETE CASCADE
);

-- Record (or replace) one verdict. Guard: the record is in the version's
-- review sample, in the same statement; when it is not, nothing is written
-- and no_data_found is raised. Owner only.
CREATE OR REPLACE FUNCTION bi.record_review_v1(p_job text, p_record text, p_verdict text, p_comment text,
                                              p_reviewer text)
RETURNS TABLE (job_version text, record_id text, verdict text, reviewer text, reviewed_at timestamptz)
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
#variable_conflict use_column
BEGIN
    IF nullif(btrim(p_reviewer), '') IS NULL THEN
        RAISE EXCEPTION 'a review needs the reviewer''s name' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    RETURN QUERY
    INSERT INTO bi.reviews AS r (job_version, record_id, verdict, comment, reviewer)
    SELECT s.job_version, s.record_id, p_verdict, nullif(btrim(p_comment), ''), p_reviewer
      FROM bi.review_sample s WHERE s.job_version = p_job AND s.record_id = p_record
    ON CONFLICT ON CONSTRAINT reviews_pkey DO UPDATE
       SET verdict = excluded.verdict, comment = excluded.comment, reviewer = excluded.reviewer,
           reviewed_at = clock_timestamp()
    RETURNING r.job_version, r.record_id, r.verdict, r.reviewer, r.reviewed_at;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'record % is not in the review sample of job version % (validate it first)', p_record, p_job
            USING ERRCODE = 'no_data_found';
    END IF;
END $$;

-- The review state of a version against its spec's evaluation.review gate.
CREATE OR REPLACE FUNCTION bi.review_state_v1(p_job text)
RETURNS TABLE (required integer, min_right double precision, sampled bigint, reviewed bigint, right_n bigint,
               wrong_n bigint, unsure_n bigint)
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT coalesce((j.spec #>> '{evaluation,review,min_reviewed}')::integer, 0),
           coalesce((j.spec #>> '{evaluation,review,min_right}')::double precision, 0),
           (SELECT count(*) FROM bi.review_sample s WHERE s.job_version = p_job),
           count(r.verdict),
           count(*) FILTER (WHERE r.verdict = 'right'),
           count(*) FILTER (WHERE r.verdict = 'wrong'),
           count(*) FILTER (WHERE r.verdict = 'unsure')
      FROM bi.jobs j LEFT JOIN bi.reviews r ON r.job_version = j.job_version
     WHERE j.job_version = p_job
     GROUP BY j.spec;
$$;

-- Why the version's review gate is not met, one line, or NULL when it is (or
-- the spec asks for no review). Unsure verdicts count as reviewed, not right.
CREATE OR REPLACE FUNCTION bi.review_gate_problem_v1(p_job text) RETURNS text
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT CASE
        WHEN st.required = 0 AND st.min_right = 0 THEN NULL
        WHEN st.reviewed < greatest(st.required, 1)
            THEN format('review: %s of %s required sample rows reviewed', st.reviewed, greatest(st.required, 1))
        WHEN st.right_n::double precision / st.reviewed < st.min_right
            THEN format('review: %s of %s reviewed rows marked right (%s%%), under the gate of %s%%', st.right_n,
                        st.reviewed, round(100.0 * st.right_n / st.reviewed, 1), round(100 * st.min_right::numeric, 1))
    END
      FROM bi.review_state_v1(p_job) st;
$$;

-- The review sample (evaluation.sql) follows the dead letters' rule: a
-- reviewer reads it before the version is published, as its reader role.
ALTER TABLE bi.review_sample ENABLE ROW LEVEL SECURITY;
DROP POLICY IF EXISTS review_sample_acl ON bi.review_sample;
CREATE POLICY review_sample_acl ON bi.review_sample FOR SELECT TO bi_reader
USING (
    CASE WHEN acl IS NULL
         THEN job_version = ANY ((SELECT bi.null_acl_readable_jobs_v1())::text[])
         ELSE acl && (SELECT bi.current_principals())
    END
);
-- A verdict's comment may quote the record: readable with the row it is on.
ALTER TABLE bi.reviews ENABLE ROW LEVEL SECURITY;
DROP POLICY IF EXISTS reviews_of_visible_rows ON bi.reviews;
CREATE POLICY reviews_of_visible_rows ON bi.reviews FOR SELECT TO bi_reader
USING (EXISTS (SELECT 1 FROM bi.review_sample s
                WHERE s.job_version = reviews.job_version AND s.record_id = reviews.record_id));
GRANT SELECT ON bi.review_sample, bi.reviews TO bi_reader;

-- Publish: switch the dataset's pointer to p_job and record it, in one
-- transaction. Refused (SQLSTATE 55000, one line) when the version belongs to
-- another dataset, is dropped, still has shards to do, or is not validated and
-- not forced with a reason. Publishing the version already published is a
-- no-op (an Airflow retry must not write history twice).
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
