-- 0039_shared_inputs: records stored with another record's result (the same rendered input in one
-- shard, computed once), counted per shard under the lease. Never edited.

-- Records stored with another record's result: in one shard, the records whose rendered input is
-- the same text are computed once (gpu_runner.worker) and the result is written under each record
-- id. One row a shard, added to under the lease (bi.note_shared_v1); `batch-inference status` sums
-- them.
CREATE TABLE IF NOT EXISTS bi.shared_inputs (
    job_version text NOT NULL REFERENCES bi.jobs (job_version) ON DELETE CASCADE,
    shard_no    integer NOT NULL,
    records     bigint NOT NULL CHECK (records >= 0),
    PRIMARY KEY (job_version, shard_no)
);
REVOKE ALL ON bi.shared_inputs FROM PUBLIC;

CREATE OR REPLACE FUNCTION bi.note_shared_v1(p_job text, p_shard integer, p_epoch bigint, p_worker text,
                                           p_n integer, OUT stale boolean)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM bi.assert_may_work_on_v1(p_job);
    INSERT INTO bi.shared_inputs AS x (job_version, shard_no, records)
    SELECT s.job_version, s.shard_no, greatest(p_n, 0)
      FROM bi.shards s
     WHERE s.job_version = p_job AND s.shard_no = p_shard AND bi.holds_lease_v1(s, p_epoch)
    ON CONFLICT (job_version, shard_no) DO UPDATE SET records = x.records + EXCLUDED.records;
    stale := NOT FOUND;
    IF stale THEN
        PERFORM bi.record_fence_v1(p_job, p_shard, 'note_shared', p_epoch, p_worker);
    END IF;
END $$;

GRANT EXECUTE ON FUNCTION bi.note_shared_v1(text, integer, bigint, text, integer) TO bi_worker;
