-- 0016_snapshot_job_version_default: submit writes the snapshot partition
-- without its job_version column, and bi.attach_snapshot_v2 adds it as a
-- constant default (stored once, not in every row) together with the
-- partition's constraints, then attaches it. bi.attach_snapshot_v1 stays for
-- submits that still write the column. Never edited.

-- The job version is a constant of the partition, so it is not written into
-- every row: ADD COLUMN with a constant default stores the value once, in the
-- catalog, and each row reads it from there (no rewrite). The same ALTER
-- checks the NOT NULL columns and the CHECK that lets ATTACH skip its own
-- validation scan, in one scan. The partition's job_version column is then its
-- last, where the parent has it first; columns are matched by name.
CREATE OR REPLACE FUNCTION bi.attach_snapshot_v2(p_job text) RETURNS void
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    part text := 'snapshot_rows_' || substr(md5(p_job), 1, 16);
BEGIN
    EXECUTE format('ALTER TABLE bi.%I ADD COLUMN job_version text NOT NULL DEFAULT %L '
                   'CONSTRAINT %I CHECK (job_version = %L), ALTER COLUMN record_id SET NOT NULL, '
                   'ALTER COLUMN text SET NOT NULL, ALTER COLUMN content_hash SET NOT NULL',
                   part, p_job, part || '_jv', p_job);
    EXECUTE format('ALTER TABLE bi.snapshot_rows ATTACH PARTITION bi.%I FOR VALUES IN (%L)', part, p_job);
END $$;
