-- 0020_bounded_reads: the dashboard's dead-letter and shard-time reads cost
-- the same whatever the job's size.
--
-- bi.dead_letter_counts: a job's dead letters counted per (ACL, reason,
-- stage), kept by a statement trigger on bi.dead_letters, under the same
-- row-level security rule as the dead letters (the rule reads only the job
-- version and the ACL, so a reader sees exactly the counts of the dead
-- letters it may read); existing dead letters are counted in.
--
-- shards_done_at: the done shards of a job in completion order (the
-- progress panel's burn-down without samples, and the job's finish time).
-- done_at and shard_no change at most once per shard, so the shard row's
-- other updates stay HOT. Never edited.

CREATE TABLE IF NOT EXISTS bi.dead_letter_counts (
    job_version text NOT NULL REFERENCES bi.jobs (job_version) ON DELETE CASCADE,
    acl         text[],
    reason      text NOT NULL,
    stage       text NOT NULL,
    n           bigint NOT NULL,
    CONSTRAINT dead_letter_counts_key UNIQUE NULLS NOT DISTINCT (job_version, acl, reason, stage)
);

CREATE OR REPLACE FUNCTION bi.dead_letter_counts_add_v1() RETURNS trigger
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    INSERT INTO bi.dead_letter_counts AS t (job_version, acl, reason, stage, n)
    SELECT a.job_version, a.acl, a.reason, a.stage, count(*)
      FROM added a
     GROUP BY 1, 2, 3, 4
     ORDER BY 1, 2, 3, 4
    ON CONFLICT ON CONSTRAINT dead_letter_counts_key DO UPDATE SET n = t.n + excluded.n;
    RETURN NULL;
END $$;

DROP TRIGGER IF EXISTS dead_letters_counts_insert ON bi.dead_letters;
CREATE TRIGGER dead_letters_counts_insert AFTER INSERT ON bi.dead_letters
    REFERENCING NEW TABLE AS added FOR EACH STATEMENT EXECUTE FUNCTION bi.dead_letter_counts_add_v1();

INSERT INTO bi.dead_letter_counts (job_version, acl, reason, stage, n)
SELECT d.job_version, d.acl, d.reason, d.stage, count(*)
  FROM bi.dead_letters d JOIN bi.jobs j ON j.job_version = d.job_version
 GROUP BY 1, 2, 3, 4
ON CONFLICT ON CONSTRAINT dead_letter_counts_key DO NOTHING;

ALTER TABLE bi.dead_letter_counts ENABLE ROW LEVEL SECURITY;
DROP POLICY IF EXISTS dead_letter_counts_acl ON bi.dead_letter_counts;
CREATE POLICY dead_letter_counts_acl ON bi.dead_letter_counts FOR SELECT TO bi_reader
USING (
    CASE WHEN acl IS NULL
         THEN job_version = ANY ((SELECT bi.null_acl_readable_jobs_v1())::text[])
         ELSE acl && (SELECT bi.current_principals())
    END
);
GRANT SELECT ON bi.dead_letter_counts TO bi_reader;

CREATE INDEX IF NOT EXISTS shards_done_at ON bi.shards (job_version, done_at, shard_no) WHERE done_at IS NOT NULL;
