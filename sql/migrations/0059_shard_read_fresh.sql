-- 0059_shard_read_fresh: bi.shard_records_v4 reads a shard with nothing stored or dead, in a job
-- with no attempts row (a shard's first read), by the shard index's range alone: no anti-join of
-- results or dead letters and no probe of attempts, each record's attempts and crashes 0. The
-- same arguments, rows and guards. Never edited.

CREATE OR REPLACE FUNCTION bi.shard_records_v4(p_job text, p_shard integer, p_epoch bigint, p_after text,
                                              p_limit integer)
RETURNS TABLE (record_id text, text text, attempts integer, crashes integer)
LANGUAGE plpgsql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
#variable_conflict use_column
DECLARE
    v_tried boolean;
    v_stored integer;
    v_dead integer;
BEGIN
    PERFORM bi.assert_may_work_on_v1(p_job);
    SELECT s.stored, s.dead INTO v_stored, v_dead
      FROM bi.shards s WHERE s.job_version = p_job AND s.shard_no = p_shard AND bi.holds_lease_v1(s, p_epoch);
    IF NOT FOUND THEN
        RETURN;
    END IF;
    v_tried := EXISTS (SELECT 1 FROM bi.attempts a WHERE a.job_version = p_job);
    IF NOT v_tried AND v_stored = 0 AND v_dead = 0 THEN
        RETURN QUERY
        SELECT sr.record_id, sr.text, 0, 0
          FROM bi.snapshot_rows sr
         WHERE sr.job_version = p_job AND sr.shard_no = p_shard
           AND sr.record_id ~>=~ coalesce(p_after, '') AND (p_after IS NULL OR sr.record_id <> p_after)
         ORDER BY sr.record_id USING ~<~
         LIMIT p_limit;
        RETURN;
    END IF;
    RETURN QUERY
    SELECT sr.record_id, sr.text, coalesce(a.attempts, 0), coalesce(a.crashes, 0)
      FROM bi.snapshot_rows sr
      LEFT JOIN LATERAL (SELECT x.attempts, x.crashes FROM bi.attempts x
                          WHERE v_tried AND x.job_version = sr.job_version AND x.record_id = sr.record_id
                         OFFSET 0) a ON true
     WHERE sr.job_version = p_job AND sr.shard_no = p_shard
       AND sr.record_id ~>=~ coalesce(p_after, '') AND (p_after IS NULL OR sr.record_id <> p_after)
       AND (v_stored = 0 OR NOT EXISTS (SELECT 1 FROM bi.results r
                                         WHERE r.job_version = sr.job_version AND r.record_id = sr.record_id))
       AND (v_dead = 0 OR NOT EXISTS (SELECT 1 FROM bi.dead_letters d
                                       WHERE d.job_version = sr.job_version AND d.record_id = sr.record_id))
     ORDER BY sr.record_id USING ~<~
     LIMIT p_limit;
END $$;
