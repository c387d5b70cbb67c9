-- 0006_result_engine: every result row says which engine made it and the
-- class of that engine's endpoint (local: in the worker's process; internal:
-- an endpoint inside the company; hosted: outside it), next to its
-- transport. bi.put_results_v3 takes both once per call and replaces
-- bi.put_results_v2, which is dropped; rows written before this migration
-- record neither (NULL). Never edited.

ALTER TABLE bi.results
    ADD COLUMN engine text,
    ADD COLUMN endpoint text CHECK (endpoint IN ('local', 'internal', 'hosted')),
    ADD CONSTRAINT results_engine_endpoint CHECK ((engine IS NULL) = (endpoint IS NULL));

-- Put-if-absent results for one shard under the current epoch. The shard row
-- is locked first, so a concurrent claim (which bumps the epoch) waits for
-- this batch to commit, and a batch from a stale epoch writes nothing. While
-- the lock is held no record of the shard can be dead-lettered, so with the
-- shard's dead counter at 0 the per-record dead-letter probe is skipped.
-- p_engine and p_endpoint (the engine that made every output of the call,
-- and its endpoint class) go on each row. n is the number of new rows.
CREATE OR REPLACE FUNCTION bi.put_results_v3(p_job text, p_shard integer, p_epoch bigint, p_worker text,
                                            p_transport text, p_engine text, p_endpoint text, p_ids text[],
                                            p_outputs jsonb[], p_categories text[],
                                            OUT stale boolean, OUT n integer)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v_dead bigint;
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
    INSERT INTO bi.results (job_version, record_id, output, category, model_name, model_digest,
                            prompt_version, transport, engine, endpoint, worker_id, epoch, acl, content_hash)
    SELECT p_job, u.id, u.output, u.category, j.model_name, j.model_digest, j.prompt_version,
           p_transport, p_engine, p_endpoint, p_worker, p_epoch, sr.acl, sr.content_hash
      FROM unnest(p_ids, p_outputs, p_categories) AS u(id, output, category)
     CROSS JOIN LATERAL (SELECT x.acl, x.content_hash, x.shard_no FROM bi.snapshot_rows x
                          WHERE x.job_version = p_job AND x.record_id = u.id OFFSET 0) sr
      JOIN bi.jobs j ON j.job_version = p_job
     WHERE sr.shard_no = p_shard
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

DROP FUNCTION bi.put_results_v2(text, integer, bigint, text, text, text[], jsonb[], text[]);

GRANT EXECUTE ON FUNCTION
    bi.put_results_v3(text, integer, bigint, text, text, text, text, text[], jsonb[], text[])
TO bi_worker;
