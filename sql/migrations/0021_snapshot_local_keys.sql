-- 0021_snapshot_local_keys: each snapshot partition keys its rows itself, by
-- record_id (its primary key) and (shard_no, record_id) (its shard index),
-- instead of carrying the parent's (job_version, record_id) key and
-- (job_version, shard_no) index: a partition holds one job version, so the
-- constant first column only made every index entry longer and every
-- comparison of the index builds at submit start with it. The shard index
-- holds record_id so that a shard is read in pages in its order
-- (bi.shard_records_v3, 0022). Existing partitions get the same two indexes
-- after the parent's are dropped. Never edited.

DO $$
DECLARE
    part text;
BEGIN
    ALTER TABLE bi.snapshot_rows DROP CONSTRAINT snapshot_rows_pkey;
    DROP INDEX bi.snapshot_rows_shard;
    FOR part IN SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
                 WHERE i.inhparent = 'bi.snapshot_rows'::regclass ORDER BY c.relname LOOP
        EXECUTE format('ALTER TABLE bi.%I ADD CONSTRAINT %I PRIMARY KEY (record_id)', part, part || '_pkey');
        EXECUTE format('CREATE INDEX %I ON bi.%I (shard_no, record_id)', part || '_shard', part);
    END LOOP;
END $$;

CREATE OR REPLACE FUNCTION bi.attach_snapshot_v1(p_job text) RETURNS void
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    part text := 'snapshot_rows_' || substr(md5(p_job), 1, 16);
BEGIN
    -- One ALTER, one scan; the CHECK lets ATTACH skip its own validation scan.
    -- The primary key is built in the same ALTER (a duplicate id fails it).
    EXECUTE format('ALTER TABLE bi.%I ALTER COLUMN job_version SET NOT NULL, ALTER COLUMN record_id SET NOT NULL, '
                   'ALTER COLUMN text SET NOT NULL, ALTER COLUMN content_hash SET NOT NULL, '
                   'ADD CONSTRAINT %I CHECK (job_version = %L), ADD CONSTRAINT %I PRIMARY KEY (record_id)',
                   part, part || '_jv', p_job, part || '_pkey');
    EXECUTE format('CREATE INDEX %I ON bi.%I (shard_no, record_id)', part || '_shard', part);
    EXECUTE format('ALTER TABLE bi.snapshot_rows ATTACH PARTITION bi.%I FOR VALUES IN (%L)', part, p_job);
END $$;
