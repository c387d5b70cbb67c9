-- evaluation: the review sample of a job version and the human verdicts on it.
--
-- validate stores the seeded sample here (bi.review_sample, the rows the
-- evaluation suite and reviewers look at, input text beside output); a
-- reviewer's verdict on a row is one row of bi.reviews, replaced when the row
-- is reviewed again, with who said it. The review gate (the spec's
-- evaluation.review) is computed by bi.review_gate_problem_v1 and checked by
-- bi.publish_v1 in the statement that switches the pointer, as is a
-- reviewer's rejection of the whole version (bi.review_rejections). Readers see the
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

-- A version's companion job versions, the golden run and the judge
-- (evaluation.run_companion): each has a version of its own, and one golden
-- run may serve several versions of a spec. A companion is left out of job
-- lists unless asked for, shown on the page of each version it serves, and
-- dropped with the last of them (bi.drop_job_version_v1). A row goes with
-- either of its versions.
CREATE TABLE IF NOT EXISTS bi.companion_versions (
    job_version text NOT NULL REFERENCES bi.jobs (job_version) ON DELETE CASCADE,
    companion   text NOT NULL REFERENCES bi.jobs (job_version) ON DELETE CASCADE,
    kind        text NOT NULL CHECK (kind IN ('golden', 'judge')),
    PRIMARY KEY (job_version, companion),
    CHECK (companion <> job_version)
);
CREATE INDEX IF NOT EXISTS companion_versions_companion ON bi.companion_versions (companion);

-- Record (or replace) one verdict. Guard: the record is in the version's
-- review sample, in the same statement; when it is not, nothing is written
-- and no_data_found is raised. The same statement takes a key-share lock on
-- the version's bi.jobs row, which conflicts with the FOR UPDATE lock
-- bi.publish_v1 holds from before its review gate check to its commit: a
-- verdict either commits before the check (which then counts it) or waits
-- until the publish has committed. Owner only.
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
      FROM bi.review_sample s
      JOIN (SELECT jb.job_version FROM bi.jobs jb WHERE jb.job_version = p_job FOR KEY SHARE) jb
        ON jb.job_version = s.job_version
     WHERE s.job_version = p_job AND s.record_id = p_record
    ON CONFLICT ON CONSTRAINT reviews_pkey DO UPDATE
       SET verdict = excluded.verdict, comment = excluded.comment, reviewer = excluded.reviewer,
           reviewed_at = clock_timestamp()
    RETURNING r.job_version, r.record_id, r.verdict, r.reviewer, r.reviewed_at;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'record % is not in the review sample of job version % (validate it first)', p_record, p_job
            USING ERRCODE = 'no_data_found';
    END IF;
END $$;

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
