-- 0018_results_hash_parts: each job version's results partition is
-- HASH-partitioned by record_id into 8 tables, so the fleet's puts into one
-- job extend eight heaps and eight primary-key indexes, each under its own
-- relation extension lock, instead of one. Job versions submitted before keep
-- their single results partition; every statement reads and drops both
-- shapes alike. Never edited.

-- Partitions of one job version, created at submit. Each is created on its
-- own and then attached: CREATE TABLE ... PARTITION OF would take an ACCESS
-- EXCLUSIVE lock on the parent and queue behind readers of a published view,
-- ATTACH PARTITION takes only SHARE UPDATE EXCLUSIVE. The results partition
-- is itself HASH-partitioned by record_id into 8 tables (results_<suffix>_0
-- .. _7), created under it before it is attached: a whole fleet puts into one
-- job at once, and each of the 8 heaps and primary-key indexes has its own
-- relation extension lock, so the writers queue to extend eight relations
-- instead of one. (job_version, record_id) stays the key: it holds the hash
-- key. The snapshot partition
-- is written by submit itself with CREATE TABLE AS (the bulk path, no index
-- maintenance per row); bi.attach_snapshot_v1 then adds its constraints in one
-- scan and attaches it, which builds its indexes in one sort each.
CREATE OR REPLACE FUNCTION bi.create_job_partitions_v1(p_job text) RETURNS text
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    t text;
    part text;
    suffix text := substr(md5(p_job), 1, 16);
    hash_parts constant integer := 8;
BEGIN
    FOREACH t IN ARRAY ARRAY['results', 'dead_letters', 'attempts'] LOOP
        part := t || '_' || suffix;
        IF to_regclass(format('bi.%I', part)) IS NULL THEN
            EXECUTE format('CREATE TABLE bi.%I (LIKE bi.%I INCLUDING DEFAULTS INCLUDING CONSTRAINTS)%s', part, t,
                           CASE WHEN t = 'results' THEN ' PARTITION BY HASH (record_id)' ELSE '' END);
            IF t = 'results' THEN
                FOR i IN 0 .. hash_parts - 1 LOOP
                    EXECUTE format('CREATE TABLE bi.%I PARTITION OF bi.%I FOR VALUES WITH (MODULUS %s, REMAINDER %s)',
                                   part || '_' || i, part, hash_parts, i);
                END LOOP;
            END IF;
            EXECUTE format('ALTER TABLE bi.%I ATTACH PARTITION bi.%I FOR VALUES IN (%L)', t, part, p_job);
        END IF;
    END LOOP;
    RETURN 'snapshot_rows_' || suffix;   -- the name submit creates the snapshot under
END $$;
