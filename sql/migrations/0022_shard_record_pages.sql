-- 0022_shard_record_pages: the claim's shard read comes in pages
-- (bi.shard_records_v3, a keyset on record_id and a limit) instead of the
-- whole shard in one call (bi.shard_records_v2, dropped: the worker of this
-- release reads pages). Never edited.

-- The records of a leased shard still to do, with each one's failed attempts
-- and crashes (> 0: a suspect, run it alone), readable only by the current
-- epoch's holder: a worker never reads rows of a shard it does not hold.
-- One page at a time, in record_id order: the first p_limit records after
-- p_after (NULL: from the start; a NULL p_limit: all the rest). A worker
-- reads its shard page by page (Ledger.record_columns), so no call carries
-- the whole shard's text and holds a pooled server connection that long; a
-- page is one range of the snapshot's shard index (shard_no, record_id),
-- read in its order and stopped at the limit: neither sorted nor read again
-- by the pages after it ('' is the least text, so the range starts at the
-- shard's first record when p_after is NULL, and p_after itself is left out).
-- Every result and dead letter of a shard's record is written with the shard
-- row locked and counted in shards.stored / shards.dead, so a shard with
-- nothing stored (or nothing dead) skips that anti-join; the OR
-- short-circuits per row. A job with no attempts row at all (no failure, no
-- crash yet: nearly every read) skips the probe of bi.attempts per record:
-- the probe's gate (v_tried, a one-time filter in the generic plan as well)
-- sits inside the LATERAL subquery, which OFFSET 0 keeps from being pulled up
-- into a join filter tested after the probe. The queries read one snapshot
-- (STABLE), so neither the lease nor an attempt can change between them.
CREATE OR REPLACE FUNCTION bi.shard_records_v3(p_job text, p_shard integer, p_epoch bigint, p_after text,
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
    RETURN QUERY
    SELECT sr.record_id, sr.text, coalesce(a.attempts, 0), coalesce(a.crashes, 0)
      FROM bi.snapshot_rows sr
      LEFT JOIN LATERAL (SELECT x.attempts, x.crashes FROM bi.attempts x
                          WHERE v_tried AND x.job_version = sr.job_version AND x.record_id = sr.record_id
                         OFFSET 0) a ON true
     WHERE sr.job_version = p_job AND sr.shard_no = p_shard
       AND sr.record_id >= coalesce(p_after, '') AND (p_after IS NULL OR sr.record_id <> p_after)
       AND (v_stored = 0 OR NOT EXISTS (SELECT 1 FROM bi.results r
                                         WHERE r.job_version = sr.job_version AND r.record_id = sr.record_id))
       AND (v_dead = 0 OR NOT EXISTS (SELECT 1 FROM bi.dead_letters d
                                       WHERE d.job_version = sr.job_version AND d.record_id = sr.record_id))
     ORDER BY sr.record_id
     LIMIT p_limit;
END $$;

REVOKE ALL ON FUNCTION bi.shard_records_v3(text, integer, bigint, text, integer) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION bi.shard_records_v3(text, integer, bigint, text, integer) TO bi_worker;
DROP FUNCTION bi.shard_records_v2(text, integer, bigint);
