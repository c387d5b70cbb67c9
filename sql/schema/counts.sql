-- counts: a job's live counts, kept in stripes so that reading them costs the
-- same at ten shards or a hundred thousand, and the ledger's autovacuum
-- settings.
--
-- bi.shards holds each shard's counters (stored, stored_fallback, stored_hosted, dead) and
-- state; the cutoff polls their totals. Summing the shard table grows with
-- the shards, and one job-wide row that every write updates would serialize
-- every worker's put on it. So the totals live in bi.shard_stripes, one row
-- per (job version, shard_no % 1024): triggers on bi.shards add each change
-- to its shard's stripe in the same transaction, and bi.job_counts_v1 sums at
-- most 1,024 rows. Workers claim shards in shard_no order, so the shards held
-- at one time are close to consecutive numbers, and consecutive numbers fall
-- in different stripes: up to 1,024 concurrent holders never share a row.

CREATE TABLE IF NOT EXISTS bi.shard_stripes (
    job_version     text NOT NULL REFERENCES bi.jobs (job_version) ON DELETE CASCADE,
    stripe          integer NOT NULL,            -- shard_no % bi.shard_stripe_count_v1()
    pending         bigint NOT NULL DEFAULT 0,   -- shards in each state
    leased          bigint NOT NULL DEFAULT 0,
    done            bigint NOT NULL DEFAULT 0,
    stored          bigint NOT NULL DEFAULT 0,   -- the sums of the shards' counters
    stored_fallback bigint NOT NULL DEFAULT 0,
    stored_hosted   bigint NOT NULL DEFAULT 0,
    dead            bigint NOT NULL DEFAULT 0,
    pending_records bigint NOT NULL DEFAULT 0,   -- the records of the shards in each state
    leased_records  bigint NOT NULL DEFAULT 0,
    done_records    bigint NOT NULL DEFAULT 0,
    -- the sums over the stripe's shards' provider batches (sql/schema/hosted.sql keeps them): the
    -- providers' reported usage, and the batches not abandoned that have not reported it
    hosted_input_tokens  bigint NOT NULL DEFAULT 0,
    hosted_output_tokens bigint NOT NULL DEFAULT 0,
    hosted_unpriced      bigint NOT NULL DEFAULT 0,
    first_claim_at  timestamptz,                 -- the earliest first claim of the stripe's shards
    PRIMARY KEY (job_version, stripe)
) WITH (fillfactor = 50, autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 5000,
        autovacuum_vacuum_cost_delay = 0);

CREATE OR REPLACE FUNCTION bi.shard_stripe_count_v1() RETURNS integer
LANGUAGE sql IMMUTABLE AS $$ SELECT 1024 $$;

-- New shards (submit inserts a job's shards in one statement): their totals, per stripe.
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

-- Removed shards (a job version dropped without its jobs row going too): their totals out.
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

-- One shard changed state or counters: the difference, to its stripe. A
-- renewal changes neither, so the trigger's WHEN clause skips it.
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

DROP TRIGGER IF EXISTS shards_stripes_insert ON bi.shards;
CREATE TRIGGER shards_stripes_insert AFTER INSERT ON bi.shards
    REFERENCING NEW TABLE AS added FOR EACH STATEMENT EXECUTE FUNCTION bi.stripes_add_shards_v1();
DROP TRIGGER IF EXISTS shards_stripes_delete ON bi.shards;
CREATE TRIGGER shards_stripes_delete AFTER DELETE ON bi.shards
    REFERENCING OLD TABLE AS removed FOR EACH STATEMENT EXECUTE FUNCTION bi.stripes_remove_shards_v1();
DROP TRIGGER IF EXISTS shards_stripes_update ON bi.shards;
CREATE TRIGGER shards_stripes_update AFTER UPDATE OF state, stored, stored_fallback, stored_hosted, dead,
    first_claim_at ON bi.shards FOR EACH ROW
    WHEN (OLD.state IS DISTINCT FROM NEW.state OR OLD.stored IS DISTINCT FROM NEW.stored
          OR OLD.stored_fallback IS DISTINCT FROM NEW.stored_fallback
          OR OLD.stored_hosted IS DISTINCT FROM NEW.stored_hosted OR OLD.dead IS DISTINCT FROM NEW.dead
          OR OLD.first_claim_at IS DISTINCT FROM NEW.first_claim_at)
    EXECUTE FUNCTION bi.stripes_change_shard_v1();

-- Live counts from the stripes: at most 1,024 rows a job, whatever its size.
CREATE OR REPLACE FUNCTION bi.job_counts_v1(p_job text)
RETURNS TABLE (records bigint, stored bigint, stored_batch bigint, stored_fallback bigint, reused bigint,
               dead_letters bigint, outstanding bigint, shards_pending bigint, shards_leased bigint,
               shards_done bigint, mode text, status text, first_claim_at timestamptz)
LANGUAGE plpgsql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
#variable_conflict use_column
BEGIN
    PERFORM bi.assert_may_work_on_v1(p_job);
    RETURN QUERY
    SELECT j.records,
           j.reused + coalesce(sum(c.stored), 0)::bigint,
           coalesce(sum(c.stored - c.stored_fallback), 0)::bigint,
           coalesce(sum(c.stored_fallback), 0)::bigint,
           j.reused,
           j.planned_dead + coalesce(sum(c.dead), 0)::bigint,
           j.records - j.reused - j.planned_dead - coalesce(sum(c.stored + c.dead), 0)::bigint,
           coalesce(sum(c.pending), 0)::bigint,
           coalesce(sum(c.leased), 0)::bigint,
           coalesce(sum(c.done), 0)::bigint,
           j.mode, j.status, min(c.first_claim_at)
      FROM bi.jobs j
      LEFT JOIN bi.shard_stripes c ON c.job_version = j.job_version
     WHERE j.job_version = p_job
     GROUP BY j.job_version;
END $$;

-- A job's stored rows per output category (the drift panel before the
-- validation report holds them): bi.put_results_v3 adds each call's rows to
-- the stripe of its shard (shard_no % 64), plan_reuse the reused rows to
-- stripe 0, a trigger an update's difference (results are never deleted but
-- with their job version), so a read sums at most 64 rows a category. 64, not the shard
-- stripes' 1,024: the read is per category, and workers claim consecutive
-- shards, so up to 64 concurrent holders never share a row.
CREATE TABLE IF NOT EXISTS bi.category_stripes (
    job_version text NOT NULL REFERENCES bi.jobs (job_version) ON DELETE CASCADE,
    stripe      integer NOT NULL,    -- shard_no % bi.category_stripe_count_v1(); 0 for reused rows
    category    text,
    n           bigint NOT NULL,
    CONSTRAINT category_stripes_key UNIQUE NULLS NOT DISTINCT (job_version, stripe, category)
) WITH (fillfactor = 50);

CREATE OR REPLACE FUNCTION bi.category_stripe_count_v1() RETURNS integer
LANGUAGE sql IMMUTABLE AS $$ SELECT 64 $$;

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

-- A job's dead letters counted per (ACL, reason, stage), so that the dashboard
-- counts and groups what a reader may see without reading the dead letters:
-- the table has the dead letters' row-level security rule (publish.sql),
-- which reads only the job version and the ACL. Statement triggers on
-- bi.dead_letters add each insert's rows, each update's difference and take
-- off each delete's (a re-drive's; a dropped job version's partitions go with
-- no trigger, and its jobs row takes these with it).
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

-- A statement that deletes dead letters (a re-drive, bi.redrive_dead_letters_v1):
-- their counts, from their groups.
CREATE OR REPLACE FUNCTION bi.dead_letter_counts_remove_v1() RETURNS trigger
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    UPDATE bi.dead_letter_counts t
       SET n = t.n - r.n
      FROM (SELECT o.job_version, o.acl, o.reason, o.stage, count(*) AS n FROM old_rows o GROUP BY 1, 2, 3, 4) r
     WHERE t.job_version = r.job_version AND t.acl IS NOT DISTINCT FROM r.acl AND t.reason = r.reason
       AND t.stage = r.stage;
    RETURN NULL;
END $$;

DROP TRIGGER IF EXISTS dead_letters_counts_delete ON bi.dead_letters;
CREATE TRIGGER dead_letters_counts_delete AFTER DELETE ON bi.dead_letters
    REFERENCING OLD TABLE AS old_rows FOR EACH STATEMENT EXECUTE FUNCTION bi.dead_letter_counts_remove_v1();

-- The shard table takes an update for every claim, renewal, put and
-- completion: every renewal leaves a dead tuple, so autovacuum visits it
-- after a fixed number of them rather than a fraction of a table that grows
-- with every job, without sleeping between pages; fillfactor leaves room on
-- each page for those updates to stay HOT (no index entry per update).
ALTER TABLE bi.shards SET (fillfactor = 70, autovacuum_vacuum_scale_factor = 0,
                           autovacuum_vacuum_threshold = 10000, autovacuum_vacuum_cost_delay = 0,
                           autovacuum_analyze_scale_factor = 0.05);

-- Records stored with another record's result: in one shard, the records whose rendered input is
-- the same text are computed once (gpu_runner.worker) and the result is written under each record
-- id. One row a shard, added to under the lease (bi.note_shared_v1); `batch-inference status` sums
-- them.
CREATE TABLE IF NOT EXISTS bi.shared_inputs (
    job_version text NOT NULL REFERENCES bi.jobs (job_version) ON DELETE CASCADE,
    shard_no    integer NOT NULL,
    records     bigint NOT NULL CHECK (records >= 0),
    PRIMARY KEY (job_version, shard_no)
);

CREATE OR REPLACE FUNCTION bi.note_shared_v1(p_job text, p_shard integer, p_epoch bigint, p_worker text,
                                           p_n integer, OUT stale boolean)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM bi.assert_may_work_on_v1(p_job);
    INSERT INTO bi.shared_inputs AS x (job_version, shard_no, records)
    SELECT s.job_version, s.shard_no, greatest(p_n, 0)
      FROM bi.shards s
     WHERE s.job_version = p_job AND s.shard_no = p_shard AND bi.holds_lease_v1(s, p_epoch)
    ON CONFLICT (job_version, shard_no) DO UPDATE SET records = x.records + EXCLUDED.records;
    stale := NOT FOUND;
    IF stale THEN
        PERFORM bi.record_fence_v1(p_job, p_shard, 'note_shared', p_epoch, p_worker);
    END IF;
END $$;
