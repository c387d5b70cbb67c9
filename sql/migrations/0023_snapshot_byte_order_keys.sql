-- 0023_snapshot_byte_order_keys: a snapshot partition's key and shard index
-- compare record ids as bytes (text_pattern_ops) instead of under the
-- database's collation. Measured at 1M UUID text ids in random order on the
-- embedded PostgreSQL 18.6 (C.UTF-8, which calls strcoll for each comparison
-- and uses no abbreviated keys): the key 1.4-1.7 CPU-s -> 0.5, the shard
-- index 0.75-0.82 -> 0.61-0.68; ids in id order cost the same either way
-- (docs/performance.md). The column keeps its collation, so every join and
-- comparison with results, dead letters, attempts and a user's table is as
-- before; equality is the same in both orders, so the unique index keys the
-- partition and serves record_id = x. Only the shard's pages change order:
-- byte order (bi.shard_records_v4, replacing v3), which is code point order,
-- C.UTF-8's own. New partitions get both indexes (bi.attach_snapshot_v2,
-- replacing v1); existing ones keep their primary key and get the shard
-- index rebuilt in byte order, which the pages read. Never edited.

DO $$
DECLARE
    part text;
BEGIN
    FOR part IN SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
                 WHERE i.inhparent = 'bi.snapshot_rows'::regclass ORDER BY c.relname LOOP
        EXECUTE format('DROP INDEX IF EXISTS bi.%I', part || '_shard');
        EXECUTE format('CREATE INDEX %I ON bi.%I (shard_no, record_id text_pattern_ops)', part || '_shard', part);
    END LOOP;
END $$;

CREATE OR REPLACE FUNCTION bi.attach_snapshot_v2(p_job text) RETURNS void
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    part text := 'snapshot_rows_' || substr(md5(p_job), 1, 16);
BEGIN
    -- One ALTER, one scan; the CHECK lets ATTACH skip its own validation scan.
    EXECUTE format('ALTER TABLE bi.%I ALTER COLUMN job_version SET NOT NULL, ALTER COLUMN record_id SET NOT NULL, '
                   'ALTER COLUMN text SET NOT NULL, ALTER COLUMN content_hash SET NOT NULL, '
                   'ADD CONSTRAINT %I CHECK (job_version = %L)', part, part || '_jv', p_job);
    -- The key and the shard index compare record ids as bytes (text_pattern_ops:
    -- memcmp with abbreviated keys, where the database's collation would call
    -- strcoll for every comparison): 3x less CPU for the key over ids in random
    -- order (UUIDs), the same in id order. Equality is the same under both, so
    -- the unique index is the key (a duplicate id fails it) and serves every
    -- record_id = x lookup; the shard index is read in byte order
    -- (bi.shard_records_v4).
    EXECUTE format('CREATE UNIQUE INDEX %I ON bi.%I (record_id text_pattern_ops)', part || '_key', part);
    EXECUTE format('CREATE INDEX %I ON bi.%I (shard_no, record_id text_pattern_ops)', part || '_shard', part);
    EXECUTE format('ALTER TABLE bi.snapshot_rows ATTACH PARTITION bi.%I FOR VALUES IN (%L)', part, p_job);
END $$;

DROP FUNCTION bi.attach_snapshot_v1(text);

-- The records of a leased shard still to do, with each one's failed attempts
-- and crashes (> 0: a suspect, run it alone), readable only by the current
-- epoch's holder: a worker never reads rows of a shard it does not hold.
-- One page at a time, in record_id order: the first p_limit records after
-- p_after (NULL: from the start; a NULL p_limit: all the rest). A worker
-- reads its shard page by page (Ledger.record_columns), so no call carries
-- the whole shard's text and holds a pooled server connection that long; a
-- page is one range of the snapshot's shard index (shard_no, record_id
-- text_pattern_ops: record ids in byte order, bi.attach_snapshot_v2), read in
-- its order (~>=~, USING ~<~) and stopped at the limit: neither sorted nor
-- read again by the pages after it ('' is the least text, so the range starts
-- at the shard's first record when p_after is NULL, and p_after itself is
-- left out).
-- Every result and dead letter of a shard's record is written with the shard
-- row locked and counted in shards.stored / shards.dead, so a shard with
-- nothing stored (or nothing dead) skips that anti-join; the OR
-- short-circuits per row. A job with no attempts row at all (no failure, no
-- crash yet: nearly every read) skips the probe of bi.attempts per record:
-- the probe's gate (v_tried, a one-time filter in the generic plan as well)
-- sits inside the LATERAL subquery, which OFFSET 0 keeps from being pulled up
-- into a join filter tested after the probe. The queries read one snapshot
-- (STABLE), so neither the lease nor an attempt can change between them.
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

REVOKE ALL ON FUNCTION bi.shard_records_v4(text, integer, bigint, text, integer) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION bi.shard_records_v4(text, integer, bigint, text, integer) TO bi_worker;
DROP FUNCTION bi.shard_records_v3(text, integer, bigint, text, integer);
