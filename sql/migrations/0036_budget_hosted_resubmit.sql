-- 0036_budget_hosted_resubmit: what a hosted batch worker may spend under cost.budget
-- (bi.hosted_spend_v1, with the job's budget lock) and when a version was last resubmitted
-- with changed settings (bi.jobs.resubmitted_at: a halt before it is past). Never edited.

ALTER TABLE bi.jobs ADD COLUMN IF NOT EXISTS resubmitted_at timestamptz;

-- The hosted part of a job's bill and what its provider batches still hold: rows stored
-- through hosted batch and the providers' reported usage (the job's stripes), and the
-- requests of batches not yet ended (intent, submitted) with the succeeded ones of ended
-- batches not yet reconciled: paid for once they complete, so reserved under the budget.
-- p_lock: take the job's budget lock for the caller's transaction (a worker about to open
-- a provider batch holds it until its intent row, the reservation, is written).
CREATE OR REPLACE FUNCTION bi.hosted_spend_v1(p_job text, p_lock boolean,
                                            OUT rows bigint, OUT input_tokens bigint, OUT output_tokens bigint,
                                            OUT unpriced_batches bigint, OUT in_flight bigint)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM bi.assert_may_work_on_v1(p_job);
    IF p_lock THEN
        PERFORM pg_advisory_xact_lock(hashtextextended('bi.hosted_spend:' || p_job, 0));
    END IF;
    SELECT coalesce(sum(c.stored_hosted), 0)::bigint, sum(c.hosted_input_tokens)::bigint,
           sum(c.hosted_output_tokens)::bigint, coalesce(sum(c.hosted_unpriced), 0)::bigint
      INTO rows, input_tokens, output_tokens, unpriced_batches
      FROM bi.shard_stripes c WHERE c.job_version = p_job;
    SELECT coalesce(sum(CASE WHEN h.state = 'ended' THEN h.succeeded ELSE cardinality(h.record_ids) END), 0)::bigint
      INTO in_flight
      FROM bi.hosted_batches h
     WHERE h.job_version = p_job AND h.state IN ('intent', 'submitted', 'ended');
END $$;

GRANT EXECUTE ON FUNCTION bi.hosted_spend_v1(text, boolean) TO bi_worker;
