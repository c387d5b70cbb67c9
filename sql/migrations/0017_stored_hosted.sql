-- 0017_stored_hosted: a stored_hosted counter beside stored_fallback, kept by
-- bi.put_results_v3 on the shard row and summed into the job's stripes by
-- the same triggers, so the cost report's hosted rows (hosted_cost_rows)
-- read counters instead of counting the job's results. Existing shards are
-- filled in from their results. Never edited.

ALTER TABLE bi.shards ADD COLUMN IF NOT EXISTS stored_hosted integer NOT NULL DEFAULT 0;
ALTER TABLE bi.shard_stripes ADD COLUMN IF NOT EXISTS stored_hosted bigint NOT NULL DEFAULT 0;

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
