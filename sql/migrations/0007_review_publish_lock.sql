-- 0007_review_publish_lock: a verdict and a publish of the same version are
-- serialized (bi.record_review_v1 takes a key-share lock on the version's
-- bi.jobs row, which bi.publish_v1 holds FOR UPDATE through its review gate
-- check), so a verdict recorded at the moment of publish is counted or comes
-- after the switch. Never edited.

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
