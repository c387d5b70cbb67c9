-- 0011_put_one_key_scan: bi.put_results_v3 reads the snapshot rows of a
-- call's results in one scan of the primary key for all of the call's record
-- ids, and the shard index is (job_version, shard_no) again: building its
-- record_id column cost every submit more than the range scan it served
-- saved. Never edited.

DROP INDEX IF EXISTS bi.snapshot_rows_shard;
CREATE INDEX IF NOT EXISTS snapshot_rows_shard ON bi.snapshot_rows (job_version, shard_no);

-- Put-if-absent results for one shard under the current epoch. The shard row
-- is locked first, so a concurrent claim (which bumps the epoch) waits for
-- this batch to commit, and a batch from a stale epoch writes nothing. While
-- the lock is held no record of the shard can be dead-lettered, so with the
-- shard's dead counter at 0 the per-record dead-letter probe is skipped.
-- p_engine and p_endpoint (the engine that made every output of the call,
-- and its endpoint class) go on each row. n is the number of new rows.
--
-- The snapshot side (the shard check, and the ACL and content hash every
-- result carries) is one scan of the primary key with all of the call's ids
-- (record_id = ANY: one descent, then the leaf pages in key order), hash-joined
-- to the call's arrays; the shard test is a filter (IS NOT DISTINCT FROM, which
-- no index serves), so the shard index, which holds the whole shard, is never
-- the scan. enable_nestloop and enable_seqscan are off for this function: a
-- nested loop would scan the snapshot again per result, a sequential scan
-- would read the whole job, whatever the estimates say. The plan is the
-- generic one (plan_cache_mode), made once per connection rather than at
-- every call.
CREATE OR REPLACE FUNCTION bi.put_results_v3(p_job text, p_shard integer, p_epoch bigint, p_worker text,
                                            p_transport text, p_engine text, p_endpoint text, p_ids text[],
                                            p_outputs jsonb[], p_categories text[],
                                            OUT stale boolean, OUT n integer)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET enable_nestloop = off
    SET enable_seqscan = off SET plan_cache_mode = force_generic_plan AS $$
DECLARE
    v_dead bigint;
    v_model text;
    v_digest text;
    v_prompt text;
BEGIN
    PERFORM bi.assert_may_work_on_v1(p_job);
    SELECT s.dead INTO v_dead FROM bi.shards s
     WHERE s.job_version = p_job AND s.shard_no = p_shard AND bi.holds_lease_v1(s, p_epoch)
       FOR UPDATE;
    IF NOT FOUND THEN
        PERFORM bi.record_fence_v1(p_job, p_shard, 'put_results', p_epoch, p_worker);
        stale := true;
        RETURN;
    END IF;
    SELECT j.model_name, j.model_digest, j.prompt_version INTO v_model, v_digest, v_prompt
      FROM bi.jobs j WHERE j.job_version = p_job;
    INSERT INTO bi.results (job_version, record_id, output, category, model_name, model_digest,
                            prompt_version, transport, engine, endpoint, worker_id, epoch, acl, content_hash)
    SELECT p_job, u.id, u.output, u.category, v_model, v_digest, v_prompt,
           p_transport, p_engine, p_endpoint, p_worker, p_epoch, sr.acl, sr.content_hash
      FROM unnest(p_ids, p_outputs, p_categories) AS u(id, output, category)
      JOIN bi.snapshot_rows sr ON sr.record_id = u.id
     WHERE sr.job_version = p_job AND sr.record_id = ANY (p_ids) AND sr.shard_no IS NOT DISTINCT FROM p_shard
       AND (v_dead = 0 OR NOT EXISTS (SELECT 1 FROM bi.dead_letters d
                                       WHERE d.job_version = p_job AND d.record_id = u.id))
    ON CONFLICT (job_version, record_id) DO NOTHING;
    GET DIAGNOSTICS n = ROW_COUNT;
    UPDATE bi.shards s
       SET stored = s.stored + n,
           stored_fallback = s.stored_fallback + CASE WHEN p_transport = 'fallback' THEN n ELSE 0 END
     WHERE s.job_version = p_job AND s.shard_no = p_shard;
    stale := false;
END $$;
