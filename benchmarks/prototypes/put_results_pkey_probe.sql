-- Prototype (benchmark only; the core owns sql/0002_ledger.sql): put_results_v1
-- with the snapshot lookup written as a primary-key probe per result.
--
-- Why: the shipped function joins bi.snapshot_rows on
-- (job_version, record_id, shard_no). Inside PL/pgSQL the plan is cached;
-- from the sixth call on PostgreSQL may switch to a generic plan, and with no
-- statistics on the freshly created partition it estimates 1 row for
-- (job_version, shard_no) and nests the unnest() inside a scan of the whole
-- shard: 200 ids x 5,000 rows = 1M comparisons, 200-500 ms per 200-row flush.
-- Even with fresh statistics and a custom plan it builds a hash of all
-- 5,000 shard rows on every flush (25x read amplification at flush 200).
-- A LATERAL subquery with OFFSET 0 cannot be flattened or have the shard
-- predicate pushed into it, so each id is one probe of the primary key
-- whatever the statistics, generic plan or custom; the shard check (a
-- result only for a record of the leased shard) stays, as a filter.
CREATE OR REPLACE FUNCTION bi.put_results_v1(p_job text, p_shard integer, p_epoch bigint, p_worker text,
                                            p_transport text, p_ids text[], p_outputs jsonb[], p_categories text[])
RETURNS integer
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    n integer;
BEGIN
    PERFORM 1 FROM bi.shards s
     WHERE s.job_version = p_job AND s.shard_no = p_shard AND s.epoch = p_epoch AND s.state = 'leased'
       FOR UPDATE;
    IF NOT FOUND THEN
        PERFORM bi.record_fence_v1(p_job, p_shard, 'put_results', p_epoch, p_worker);
        RETURN -1;
    END IF;
    INSERT INTO bi.results (job_version, record_id, output, category, model_name, model_digest,
                            prompt_version, transport, worker_id, epoch, acl, content_hash)
    SELECT p_job, u.id, u.output, u.category, j.model_name, j.model_digest, j.prompt_version,
           p_transport, p_worker, p_epoch, sr.acl, sr.content_hash
      FROM unnest(p_ids, p_outputs, p_categories) AS u(id, output, category)
     CROSS JOIN LATERAL (SELECT x.acl, x.content_hash, x.shard_no FROM bi.snapshot_rows x
                          WHERE x.job_version = p_job AND x.record_id = u.id OFFSET 0) sr
      JOIN bi.jobs j ON j.job_version = p_job
     WHERE sr.shard_no = p_shard
       AND NOT EXISTS (SELECT 1 FROM bi.dead_letters d WHERE d.job_version = p_job AND d.record_id = u.id)
    ON CONFLICT (job_version, record_id) DO NOTHING;
    GET DIAGNOSTICS n = ROW_COUNT;
    UPDATE bi.shards s
       SET stored = s.stored + n,
           stored_fallback = s.stored_fallback + CASE WHEN p_transport = 'fallback' THEN n ELSE 0 END
     WHERE s.job_version = p_job AND s.shard_no = p_shard;
    RETURN n;
END $$;
