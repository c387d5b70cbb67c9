-- 0020_bounded_reads: the dashboard's dead-letter and shard-time reads cost
-- the same whatever the job's size.
--
-- bi.dead_letter_counts: a job's dead letters counted per (ACL, reason,
-- stage), kept by statement triggers on bi.dead_letters (insert, update), under the same
-- row-level security rule as the dead letters (the rule reads only the job
-- version and the ACL, so a reader sees exactly the counts of the dead
-- letters it may read); existing dead letters are counted in.
--
-- bi.category_stripes: a job's stored rows per category, per stripe of its
-- shards (shard_no % 64; reused rows in stripe 0), kept by bi.put_results_v3
-- (same signature: its insert now also counts the categories it stored) and
-- plan_reuse, and a statement trigger on an update of bi.results, so the drift panel reads at most 64 rows a category; existing
-- results are counted in.
--
-- pending_records, leased_records, done_records: the records of each
-- state's shards, in the stripes beside their counts (the same triggers keep
-- them), so the shard panel's totals by state read the stripes; existing
-- stripes are filled from their shards.
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

CREATE TABLE IF NOT EXISTS bi.category_stripes (
    job_version text NOT NULL REFERENCES bi.jobs (job_version) ON DELETE CASCADE,
    stripe      integer NOT NULL,    -- shard_no % bi.category_stripe_count_v1(); 0 for reused rows
    category    text,
    n           bigint NOT NULL,
    CONSTRAINT category_stripes_key UNIQUE NULLS NOT DISTINCT (job_version, stripe, category)
) WITH (fillfactor = 50);
REVOKE ALL ON bi.category_stripes FROM PUBLIC;

CREATE OR REPLACE FUNCTION bi.category_stripe_count_v1() RETURNS integer
LANGUAGE sql IMMUTABLE AS $$ SELECT 64 $$;

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
    -- The stored rows, and their categories counted into the shard's category stripe.
    WITH stored AS (
        INSERT INTO bi.results (job_version, record_id, output, category, model_name, model_digest,
                                prompt_version, transport, engine, endpoint, worker_id, epoch, acl, content_hash)
        SELECT p_job, u.id, u.output, u.category, v_model, v_digest, v_prompt,
               p_transport, p_engine, p_endpoint, p_worker, p_epoch, sr.acl, sr.content_hash
          FROM unnest(p_ids, p_outputs, p_categories) AS u(id, output, category)
          JOIN bi.snapshot_rows sr ON sr.record_id = u.id
         WHERE sr.job_version = p_job AND sr.record_id = ANY (p_ids) AND sr.shard_no IS NOT DISTINCT FROM p_shard
           AND (v_dead = 0 OR NOT EXISTS (SELECT 1 FROM bi.dead_letters d
                                           WHERE d.job_version = p_job AND d.record_id = u.id))
        ON CONFLICT (job_version, record_id) DO NOTHING
        RETURNING category
    ), counted AS (
        INSERT INTO bi.category_stripes AS t (job_version, stripe, category, n)
        SELECT p_job, p_shard % bi.category_stripe_count_v1(), c.category, count(*)
          FROM stored c GROUP BY c.category ORDER BY c.category
        ON CONFLICT ON CONSTRAINT category_stripes_key DO UPDATE SET n = t.n + excluded.n
    )
    SELECT count(*) INTO n FROM stored;
    UPDATE bi.shards s
       SET stored = s.stored + n,
           stored_fallback = s.stored_fallback + CASE WHEN p_transport = 'fallback' THEN n ELSE 0 END,
           stored_hosted = s.stored_hosted + CASE WHEN p_transport = 'hosted_batch' THEN n ELSE 0 END
     WHERE s.job_version = p_job AND s.shard_no = p_shard;
    stale := false;
END $$;

INSERT INTO bi.category_stripes (job_version, stripe, category, n)
SELECT r.job_version, coalesce(sr.shard_no % bi.category_stripe_count_v1(), 0), r.category, count(*)
  FROM bi.results r
  JOIN bi.jobs j ON j.job_version = r.job_version
  LEFT JOIN bi.snapshot_rows sr ON sr.job_version = r.job_version AND sr.record_id = r.record_id
 GROUP BY 1, 2, 3
ON CONFLICT ON CONSTRAINT category_stripes_key DO NOTHING;

ALTER TABLE bi.shard_stripes ADD COLUMN IF NOT EXISTS pending_records bigint NOT NULL DEFAULT 0;
ALTER TABLE bi.shard_stripes ADD COLUMN IF NOT EXISTS leased_records bigint NOT NULL DEFAULT 0;
ALTER TABLE bi.shard_stripes ADD COLUMN IF NOT EXISTS done_records bigint NOT NULL DEFAULT 0;

CREATE OR REPLACE FUNCTION bi.stripes_add_shards_v1() RETURNS trigger
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    INSERT INTO bi.shard_stripes AS t (job_version, stripe, pending, leased, done, stored, stored_fallback,
                                       stored_hosted, dead, pending_records, leased_records, done_records,
                                       first_claim_at)
    SELECT n.job_version, n.shard_no % bi.shard_stripe_count_v1(),
           count(*) FILTER (WHERE n.state = 'pending'), count(*) FILTER (WHERE n.state = 'leased'),
           count(*) FILTER (WHERE n.state = 'done'),
           sum(n.stored), sum(n.stored_fallback), sum(n.stored_hosted), sum(n.dead),
           coalesce(sum(n.records) FILTER (WHERE n.state = 'pending'), 0),
           coalesce(sum(n.records) FILTER (WHERE n.state = 'leased'), 0),
           coalesce(sum(n.records) FILTER (WHERE n.state = 'done'), 0), min(n.first_claim_at)
      FROM added n
     GROUP BY 1, 2
    ON CONFLICT (job_version, stripe) DO UPDATE
       SET pending = t.pending + excluded.pending, leased = t.leased + excluded.leased,
           done = t.done + excluded.done, stored = t.stored + excluded.stored,
           stored_fallback = t.stored_fallback + excluded.stored_fallback,
           stored_hosted = t.stored_hosted + excluded.stored_hosted, dead = t.dead + excluded.dead,
           pending_records = t.pending_records + excluded.pending_records,
           leased_records = t.leased_records + excluded.leased_records,
           done_records = t.done_records + excluded.done_records,
           first_claim_at = least(t.first_claim_at, excluded.first_claim_at);
    RETURN NULL;
END $$;

CREATE OR REPLACE FUNCTION bi.stripes_remove_shards_v1() RETURNS trigger
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    UPDATE bi.shard_stripes t
       SET pending = t.pending - o.pending, leased = t.leased - o.leased, done = t.done - o.done,
           stored = t.stored - o.stored, stored_fallback = t.stored_fallback - o.stored_fallback,
           stored_hosted = t.stored_hosted - o.stored_hosted, dead = t.dead - o.dead,
           pending_records = t.pending_records - o.pending_records,
           leased_records = t.leased_records - o.leased_records, done_records = t.done_records - o.done_records
      FROM (SELECT r.job_version, r.shard_no % bi.shard_stripe_count_v1() AS stripe,
                   count(*) FILTER (WHERE r.state = 'pending') AS pending,
                   count(*) FILTER (WHERE r.state = 'leased') AS leased,
                   count(*) FILTER (WHERE r.state = 'done') AS done,
                   sum(r.stored) AS stored, sum(r.stored_fallback) AS stored_fallback,
                   sum(r.stored_hosted) AS stored_hosted, sum(r.dead) AS dead,
                   coalesce(sum(r.records) FILTER (WHERE r.state = 'pending'), 0) AS pending_records,
                   coalesce(sum(r.records) FILTER (WHERE r.state = 'leased'), 0) AS leased_records,
                   coalesce(sum(r.records) FILTER (WHERE r.state = 'done'), 0) AS done_records
              FROM removed r GROUP BY 1, 2) o
     WHERE t.job_version = o.job_version AND t.stripe = o.stripe;
    RETURN NULL;
END $$;

CREATE OR REPLACE FUNCTION bi.stripes_change_shard_v1() RETURNS trigger
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    UPDATE bi.shard_stripes t
       SET pending = t.pending + (NEW.state = 'pending')::integer - (OLD.state = 'pending')::integer,
           leased = t.leased + (NEW.state = 'leased')::integer - (OLD.state = 'leased')::integer,
           done = t.done + (NEW.state = 'done')::integer - (OLD.state = 'done')::integer,
           stored = t.stored + NEW.stored - OLD.stored,
           stored_fallback = t.stored_fallback + NEW.stored_fallback - OLD.stored_fallback,
           stored_hosted = t.stored_hosted + NEW.stored_hosted - OLD.stored_hosted,
           dead = t.dead + NEW.dead - OLD.dead,
           pending_records = t.pending_records + CASE WHEN NEW.state = 'pending' THEN NEW.records ELSE 0 END
                                               - CASE WHEN OLD.state = 'pending' THEN OLD.records ELSE 0 END,
           leased_records = t.leased_records + CASE WHEN NEW.state = 'leased' THEN NEW.records ELSE 0 END
                                             - CASE WHEN OLD.state = 'leased' THEN OLD.records ELSE 0 END,
           done_records = t.done_records + CASE WHEN NEW.state = 'done' THEN NEW.records ELSE 0 END
                                         - CASE WHEN OLD.state = 'done' THEN OLD.records ELSE 0 END,
           first_claim_at = least(t.first_claim_at, NEW.first_claim_at)
     WHERE t.job_version = NEW.job_version AND t.stripe = NEW.shard_no % bi.shard_stripe_count_v1();
    RETURN NULL;
END $$;

UPDATE bi.shard_stripes t
   SET pending_records = o.pending_records, leased_records = o.leased_records, done_records = o.done_records
  FROM (SELECT s.job_version, s.shard_no % bi.shard_stripe_count_v1() AS stripe,
               coalesce(sum(s.records) FILTER (WHERE s.state = 'pending'), 0) AS pending_records,
               coalesce(sum(s.records) FILTER (WHERE s.state = 'leased'), 0) AS leased_records,
               coalesce(sum(s.records) FILTER (WHERE s.state = 'done'), 0) AS done_records
          FROM bi.shards s GROUP BY 1, 2) o
 WHERE t.job_version = o.job_version AND t.stripe = o.stripe;

-- A statement that changes stored rows' categories (no ledger function does;
-- an operator's fix may): the difference, to the rows' stripes.
CREATE OR REPLACE FUNCTION bi.category_stripes_change_v1() RETURNS trigger
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    INSERT INTO bi.category_stripes AS t (job_version, stripe, category, n)
    SELECT d.job_version, coalesce(sr.shard_no % bi.category_stripe_count_v1(), 0), d.category, sum(d.dn)
      FROM (SELECT o.job_version, o.record_id, o.category, -1 AS dn FROM old_rows o
            UNION ALL
            SELECT w.job_version, w.record_id, w.category, 1 FROM new_rows w) d
      LEFT JOIN bi.snapshot_rows sr ON sr.job_version = d.job_version AND sr.record_id = d.record_id
     GROUP BY 1, 2, 3 HAVING sum(d.dn) <> 0
     ORDER BY 1, 2, 3
    ON CONFLICT ON CONSTRAINT category_stripes_key DO UPDATE SET n = t.n + excluded.n;
    RETURN NULL;
END $$;

DROP TRIGGER IF EXISTS results_categories_update ON bi.results;
CREATE TRIGGER results_categories_update AFTER UPDATE ON bi.results
    REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows FOR EACH STATEMENT
    EXECUTE FUNCTION bi.category_stripes_change_v1();

-- A statement that changes dead letters (no ledger function does; an
-- operator's fix may): the difference, to their counts.
CREATE OR REPLACE FUNCTION bi.dead_letter_counts_change_v1() RETURNS trigger
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    INSERT INTO bi.dead_letter_counts AS t (job_version, acl, reason, stage, n)
    SELECT d.job_version, d.acl, d.reason, d.stage, sum(d.dn)
      FROM (SELECT o.job_version, o.acl, o.reason, o.stage, -1 AS dn FROM old_rows o
            UNION ALL
            SELECT w.job_version, w.acl, w.reason, w.stage, 1 FROM new_rows w) d
     GROUP BY 1, 2, 3, 4 HAVING sum(d.dn) <> 0
     ORDER BY 1, 2, 3, 4
    ON CONFLICT ON CONSTRAINT dead_letter_counts_key DO UPDATE SET n = t.n + excluded.n;
    RETURN NULL;
END $$;

DROP TRIGGER IF EXISTS dead_letters_counts_update ON bi.dead_letters;
CREATE TRIGGER dead_letters_counts_update AFTER UPDATE ON bi.dead_letters
    REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows FOR EACH STATEMENT
    EXECUTE FUNCTION bi.dead_letter_counts_change_v1();
