-- 0017_stored_hosted: a stored_hosted counter beside stored_fallback, kept by
-- bi.put_results_v3 on the shard row and summed into the job's stripes by
-- the same triggers, and the providers' reported usage summed into the
-- stripes by a trigger on bi.hosted_batches, so the cost report
-- (hosted_cost_rows) reads counters instead of counting the job's results
-- and batches. Existing shards and stripes are filled in from their results
-- and batches. Never edited.

ALTER TABLE bi.shards ADD COLUMN IF NOT EXISTS stored_hosted integer NOT NULL DEFAULT 0;
ALTER TABLE bi.shard_stripes ADD COLUMN IF NOT EXISTS stored_hosted bigint NOT NULL DEFAULT 0;
ALTER TABLE bi.shard_stripes ADD COLUMN IF NOT EXISTS hosted_input_tokens bigint NOT NULL DEFAULT 0;
ALTER TABLE bi.shard_stripes ADD COLUMN IF NOT EXISTS hosted_output_tokens bigint NOT NULL DEFAULT 0;
ALTER TABLE bi.shard_stripes ADD COLUMN IF NOT EXISTS hosted_unpriced bigint NOT NULL DEFAULT 0;

-- New shards (submit inserts a job's shards in one statement): their totals, per stripe.
CREATE OR REPLACE FUNCTION bi.stripes_add_shards_v1() RETURNS trigger
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    INSERT INTO bi.shard_stripes AS t (job_version, stripe, pending, leased, done, stored, stored_fallback,
                                       stored_hosted, dead, first_claim_at)
    SELECT n.job_version, n.shard_no % bi.shard_stripe_count_v1(),
           count(*) FILTER (WHERE n.state = 'pending'), count(*) FILTER (WHERE n.state = 'leased'),
           count(*) FILTER (WHERE n.state = 'done'),
           sum(n.stored), sum(n.stored_fallback), sum(n.stored_hosted), sum(n.dead), min(n.first_claim_at)
      FROM added n
     GROUP BY 1, 2
    ON CONFLICT (job_version, stripe) DO UPDATE
       SET pending = t.pending + excluded.pending, leased = t.leased + excluded.leased,
           done = t.done + excluded.done, stored = t.stored + excluded.stored,
           stored_fallback = t.stored_fallback + excluded.stored_fallback,
           stored_hosted = t.stored_hosted + excluded.stored_hosted, dead = t.dead + excluded.dead,
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
           stored_hosted = t.stored_hosted - o.stored_hosted, dead = t.dead - o.dead
      FROM (SELECT r.job_version, r.shard_no % bi.shard_stripe_count_v1() AS stripe,
                   count(*) FILTER (WHERE r.state = 'pending') AS pending,
                   count(*) FILTER (WHERE r.state = 'leased') AS leased,
                   count(*) FILTER (WHERE r.state = 'done') AS done,
                   sum(r.stored) AS stored, sum(r.stored_fallback) AS stored_fallback,
                   sum(r.stored_hosted) AS stored_hosted, sum(r.dead) AS dead
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
           first_claim_at = least(t.first_claim_at, NEW.first_claim_at)
     WHERE t.job_version = NEW.job_version AND t.stripe = NEW.shard_no % bi.shard_stripe_count_v1();
    RETURN NULL;
END $$;

DROP TRIGGER IF EXISTS shards_stripes_update ON bi.shards;
CREATE TRIGGER shards_stripes_update AFTER UPDATE OF state, stored, stored_fallback, stored_hosted, dead,
    first_claim_at ON bi.shards FOR EACH ROW
    WHEN (OLD.state IS DISTINCT FROM NEW.state OR OLD.stored IS DISTINCT FROM NEW.stored
          OR OLD.stored_fallback IS DISTINCT FROM NEW.stored_fallback
          OR OLD.stored_hosted IS DISTINCT FROM NEW.stored_hosted OR OLD.dead IS DISTINCT FROM NEW.dead
          OR OLD.first_claim_at IS DISTINCT FROM NEW.first_claim_at)
    EXECUTE FUNCTION bi.stripes_change_shard_v1();

-- Put-if-absent results for one shard under the current epoch. The shard row
-- is locked first, so a concurrent claim (which bumps the epoch) waits for
-- this batch to commit, and a batch from a stale epoch writes nothing. While
-- the lock is held no record of the shard can be dead-lettered, so with the
-- shard's dead counter at 0 the per-record dead-letter probe is skipped.
-- p_engine and p_endpoint (the engine that made every output of the call,
-- and its endpoint class) go on each row. n is the number of new rows.
--
-- The snapshot side (the shard check, and the ACL and content hash every
-- result carries) is one scan of the primary key with all of the call's ids
-- (record_id = ANY: one descent, then the leaf pages in key order), hash-joined
-- to the call's arrays; the shard test is a filter (IS NOT DISTINCT FROM, which
-- no index serves), so the shard index, which holds the whole shard, is never
-- the scan. enable_nestloop and enable_seqscan are off for this function: a
-- nested loop would scan the snapshot again per result, a sequential scan
-- would read the whole job, whatever the estimates say. The plan is the
-- generic one (plan_cache_mode), made once per connection rather than at
-- every call.
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
    INSERT INTO bi.results (job_version, record_id, output, category, model_name, model_digest,
                            prompt_version, transport, engine, endpoint, worker_id, epoch, acl, content_hash)
    SELECT p_job, u.id, u.output, u.category, v_model, v_digest, v_prompt,
           p_transport, p_engine, p_endpoint, p_worker, p_epoch, sr.acl, sr.content_hash
      FROM unnest(p_ids, p_outputs, p_categories) AS u(id, output, category)
      JOIN bi.snapshot_rows sr ON sr.record_id = u.id
     WHERE sr.job_version = p_job AND sr.record_id = ANY (p_ids) AND sr.shard_no IS NOT DISTINCT FROM p_shard
       AND (v_dead = 0 OR NOT EXISTS (SELECT 1 FROM bi.dead_letters d
                                       WHERE d.job_version = p_job AND d.record_id = u.id))
    ON CONFLICT (job_version, record_id) DO NOTHING;
    GET DIAGNOSTICS n = ROW_COUNT;
    UPDATE bi.shards s
       SET stored = s.stored + n,
           stored_fallback = s.stored_fallback + CASE WHEN p_transport = 'fallback' THEN n ELSE 0 END,
           stored_hosted = s.stored_hosted + CASE WHEN p_transport = 'hosted_batch' THEN n ELSE 0 END
     WHERE s.job_version = p_job AND s.shard_no = p_shard;
    stale := false;
END $$;

-- The hosted rows already stored, per shard (the trigger carries them to the stripes).
UPDATE bi.shards s SET stored_hosted = h.n
  FROM (SELECT r.job_version, sr.shard_no, count(*) AS n
          FROM bi.results r
          JOIN bi.snapshot_rows sr ON sr.job_version = r.job_version AND sr.record_id = r.record_id
         WHERE r.transport = 'hosted_batch' AND sr.shard_no IS NOT NULL
         GROUP BY r.job_version, sr.shard_no) h
 WHERE s.job_version = h.job_version AND s.shard_no = h.shard_no;

-- The cost report's hosted usage in the job's stripes (sql/schema/counts.sql):
-- a batch row's reported tokens, and whether it is a batch not abandoned
-- without them, added to its shard's stripe as they change, so the report
-- reads at most 1,024 rows a job instead of every batch.
CREATE OR REPLACE FUNCTION bi.stripes_change_hosted_batch_v1() RETURNS trigger
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF TG_OP IN ('UPDATE', 'DELETE') THEN
        UPDATE bi.shard_stripes t
           SET hosted_input_tokens = t.hosted_input_tokens - coalesce(OLD.input_tokens, 0),
               hosted_output_tokens = t.hosted_output_tokens - coalesce(OLD.output_tokens, 0),
               hosted_unpriced = t.hosted_unpriced
                                 - (OLD.input_tokens IS NULL AND OLD.state <> 'abandoned')::integer
         WHERE t.job_version = OLD.job_version AND t.stripe = OLD.shard_no % bi.shard_stripe_count_v1();
    END IF;
    IF TG_OP IN ('INSERT', 'UPDATE') THEN
        UPDATE bi.shard_stripes t
           SET hosted_input_tokens = t.hosted_input_tokens + coalesce(NEW.input_tokens, 0),
               hosted_output_tokens = t.hosted_output_tokens + coalesce(NEW.output_tokens, 0),
               hosted_unpriced = t.hosted_unpriced
                                 + (NEW.input_tokens IS NULL AND NEW.state <> 'abandoned')::integer
         WHERE t.job_version = NEW.job_version AND t.stripe = NEW.shard_no % bi.shard_stripe_count_v1();
    END IF;
    RETURN NULL;
END $$;

DROP TRIGGER IF EXISTS hosted_batches_stripes ON bi.hosted_batches;
CREATE TRIGGER hosted_batches_stripes AFTER INSERT OR DELETE ON bi.hosted_batches
    FOR EACH ROW EXECUTE FUNCTION bi.stripes_change_hosted_batch_v1();
DROP TRIGGER IF EXISTS hosted_batches_stripes_update ON bi.hosted_batches;
CREATE TRIGGER hosted_batches_stripes_update AFTER UPDATE OF input_tokens, output_tokens, state
    ON bi.hosted_batches FOR EACH ROW
    WHEN (OLD.input_tokens IS DISTINCT FROM NEW.input_tokens OR OLD.output_tokens IS DISTINCT FROM NEW.output_tokens
          OR OLD.state IS DISTINCT FROM NEW.state)
    EXECUTE FUNCTION bi.stripes_change_hosted_batch_v1();

-- The usage of the provider batches already there, per stripe.
UPDATE bi.shard_stripes t
   SET hosted_input_tokens = h.input_tokens, hosted_output_tokens = h.output_tokens, hosted_unpriced = h.unpriced
  FROM (SELECT b.job_version, b.shard_no % bi.shard_stripe_count_v1() AS stripe,
               coalesce(sum(b.input_tokens), 0) AS input_tokens, coalesce(sum(b.output_tokens), 0) AS output_tokens,
               count(*) FILTER (WHERE b.input_tokens IS NULL AND b.state <> 'abandoned') AS unpriced
          FROM bi.hosted_batches b GROUP BY 1, 2) h
 WHERE t.job_version = h.job_version AND t.stripe = h.stripe;
