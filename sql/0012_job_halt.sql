-- 0012_job_halt: a job's workers can stop the whole run.
--
-- A worker that cannot work at all (its weights do not match the pinned
-- digest, its engine cannot be configured) records why on the job; so does
-- LocalWorkersOperator for every fatal exit. The cutoff watch reads it at each
-- poll and ends, failing the run within a poll instead of at the deadline.
-- A halt is a fact with a time, never cleared: a watch ignores halts from
-- before its DAG run was (re)queued, so clearing the run's tasks starts afresh.
ALTER TABLE bi.jobs ADD COLUMN IF NOT EXISTS halted_at timestamptz;
ALTER TABLE bi.jobs ADD COLUMN IF NOT EXISTS halt_reason text;

CREATE OR REPLACE FUNCTION bi.halt_job_v1(p_job text, p_reason text)
RETURNS timestamptz
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v_at timestamptz;
BEGIN
    PERFORM bi.assert_may_work_on_v1(p_job);
    UPDATE bi.jobs SET halted_at = clock_timestamp(), halt_reason = left(p_reason, 2000)
     WHERE job_version = p_job AND status = 'running'
    RETURNING halted_at INTO v_at;
    RETURN v_at;
END $$;

REVOKE EXECUTE ON FUNCTION bi.halt_job_v1(text, text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION bi.halt_job_v1(text, text) TO bi_worker;
