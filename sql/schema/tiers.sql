-- tiers: the price tier of the fallback endpoint that answered each row the tiered fallback pool
-- re-drove (batch_inference.tiers). The pool's worker writes a record's tier under its shard lease
-- (bi.fallback_tier_put_v1) as the answer comes back, before the result is stored; a record answered
-- again (a retry after a bad answer) keeps the tier of its last answer, the one stored. The bill prices
-- a fallback row at its tier (sql/tiers.sql: fallback_tier_rows); a fallback row with no tier here was
-- re-driven at the fallback's one price. Gone with the job version (the foreign key).
CREATE TABLE IF NOT EXISTS bi.fallback_tiers (
    job_version text NOT NULL REFERENCES bi.jobs (job_version) ON DELETE CASCADE,
    record_id   text NOT NULL,
    tier        text NOT NULL CHECK (tier ~ '^[a-z][a-z0-9_-]{0,31}$'),
    worker_id   text,
    epoch       bigint,
    answered_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (job_version, record_id)
);

-- The tier that answered some records of one shard under the current epoch: the shard row is locked
-- as bi.put_results_v3 locks it, so a stale epoch writes nothing (stale), and a record outside the
-- shard is skipped. Arrays are parallel, one entry per record. n: rows written.
CREATE OR REPLACE FUNCTION bi.fallback_tier_put_v1(p_job text, p_shard integer, p_epoch bigint, p_worker text,
                                                  p_ids text[], p_tiers text[], OUT stale boolean, OUT n integer)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM bi.assert_may_work_on_v1(p_job);
    PERFORM 1 FROM bi.shards s
     WHERE s.job_version = p_job AND s.shard_no = p_shard AND bi.holds_lease_v1(s, p_epoch)
       FOR UPDATE;
    IF NOT FOUND THEN
        PERFORM bi.record_fence_v1(p_job, p_shard, 'fallback_tier_put', p_epoch, p_worker);
        stale := true;
        n := 0;
        RETURN;
    END IF;
    INSERT INTO bi.fallback_tiers AS t (job_version, record_id, tier, worker_id, epoch)
    SELECT p_job, u.id, u.tier, p_worker, p_epoch
      FROM unnest(p_ids, p_tiers) AS u(id, tier)
     WHERE EXISTS (SELECT 1 FROM bi.snapshot_rows sr
                    WHERE sr.job_version = p_job AND sr.record_id = u.id AND sr.shard_no = p_shard)
    ON CONFLICT (job_version, record_id) DO UPDATE
       SET tier = EXCLUDED.tier, worker_id = EXCLUDED.worker_id, epoch = EXCLUDED.epoch,
           answered_at = EXCLUDED.answered_at;
    GET DIAGNOSTICS n = ROW_COUNT;
    stale := false;
END $$;

GRANT EXECUTE ON FUNCTION bi.fallback_tier_put_v1(text, integer, bigint, text, text[], text[]) TO bi_worker;
