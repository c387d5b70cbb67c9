-- 0055_job_done_notify: the shard completion that leaves no shard of its job undone notifies channel
-- bi_done with the job version, so a cutoff watch waiting between polls reads the counts at once
-- (a run ends when its last shard does, not up to a poll later). Never edited.

CREATE OR REPLACE FUNCTION bi.complete_shard_v2(p_job text, p_shard integer, p_epoch bigint, p_worker text,
                                              OUT stale boolean, OUT done boolean)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM bi.assert_may_work_on_v1(p_job);
    UPDATE bi.shards s
       SET state = 'done', lease_owner = NULL, lease_expires_at = NULL, done_at = clock_timestamp()
     WHERE s.job_version = p_job AND s.shard_no = p_shard AND bi.holds_lease_v1(s, p_epoch)
       AND s.stored + s.dead >= s.records;
    done := FOUND;
    stale := false;
    IF done THEN
        IF NOT EXISTS (SELECT 1 FROM bi.shards s WHERE s.job_version = p_job AND s.state <> 'done') THEN
            PERFORM pg_notify('bi_done', p_job);
        END IF;
        RETURN;
    END IF;
    -- Not a guard, only the reason for the refusal.
    IF EXISTS (SELECT 1 FROM bi.shards s WHERE s.job_version = p_job AND s.shard_no = p_shard
                                          AND bi.holds_lease_v1(s, p_epoch)) THEN
        RETURN;
    END IF;
    PERFORM bi.record_fence_v1(p_job, p_shard, 'complete', p_epoch, p_worker);
    stale := true;
    done := NULL;
END $$;
