-- hosted: the hosted batch transports' provider batches (OpenAI Batch,
-- Anthropic Message Batches, Bedrock batch inference), one row per batch.
--
-- A row is written as an intent BEFORE the provider's create call: the job
-- version, the shard, the epoch that holds it and an idempotency key the
-- create call carries (OpenAI metadata, Bedrock clientRequestToken; for
-- Anthropic, which keeps no metadata, the set of custom_ids). A worker that
-- re-leases the shard after a crash finds the open row and re-attaches to the
-- batch it names, or looks it up by the key, instead of creating another.
--
-- States: intent (create not yet confirmed) -> submitted (the provider's id
-- recorded) -> ended (the provider settled every request; its counts are
-- final and its results can be read, as often as needed) -> reconciled (the
-- results were stored under a later call of the same epoch and the provider's
-- files deleted). abandoned: an intent never created, given up.
--
-- The poll mirrors the provider's request counts here, so the cutoff reads
-- the hosted work from the rows of batches in flight only
-- (bi.hosted_counts_v1), never from the provider and never from results.
CREATE TABLE IF NOT EXISTS bi.hosted_batches (
    job_version       text NOT NULL REFERENCES bi.jobs (job_version) ON DELETE CASCADE,
    shard_no          integer NOT NULL,
    intent_no         integer NOT NULL,            -- 1, 2, ... per shard
    idem_key          text NOT NULL UNIQUE,
    provider          text NOT NULL CHECK (provider IN ('openai', 'anthropic', 'bedrock', 'gemini')),
    epoch             bigint NOT NULL,             -- the epoch that recorded or last re-attached it
    record_ids        text[] NOT NULL,             -- the requests, in submission order
    provider_batch_id text,
    input_ref         text,                        -- input file id or S3 URI
    state             text NOT NULL DEFAULT 'intent'
                      CHECK (state IN ('intent', 'submitted', 'ended', 'reconciled', 'abandoned')),
    provider_status   text,
    total             integer NOT NULL DEFAULT 0,
    processing        integer NOT NULL DEFAULT 0,
    succeeded         integer NOT NULL DEFAULT 0,
    errored           integer NOT NULL DEFAULT 0,
    canceled          integer NOT NULL DEFAULT 0,
    expired           integer NOT NULL DEFAULT 0,
    collected_epoch   bigint,                      -- the epoch whose worker was handed the results
    input_tokens      bigint,                      -- the provider's reported usage, when it reports it
    output_tokens     bigint,
    created_at        timestamptz NOT NULL DEFAULT clock_timestamp(),
    confirmed_at      timestamptz,
    polled_at         timestamptz,
    cancel_requested_at timestamptz,
    ended_at          timestamptz,
    reconciled_at     timestamptz,
    PRIMARY KEY (job_version, shard_no, intent_no)
);
CREATE INDEX IF NOT EXISTS hosted_batches_in_flight ON bi.hosted_batches (job_version)
    WHERE state IN ('intent', 'submitted');

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

-- Open (or re-attach to) the shard's provider batch. The shard row is locked
-- under the fence, so two holders can never open two batches for one shard.
-- An unfinished row (intent, submitted or ended) is returned with
-- reattached = true and takes the caller's epoch; otherwise a new intent
-- with p_ids is written and returned.
CREATE OR REPLACE FUNCTION bi.hosted_open_v1(p_job text, p_shard integer, p_epoch bigint, p_worker text,
                                           p_provider text, p_ids text[],
                                           OUT stale boolean, OUT intent_no integer, OUT idem_key text,
                                           OUT provider_batch_id text, OUT state text, OUT record_ids text[],
                                           OUT reattached boolean, OUT collected_epoch bigint,
                                           OUT created_at timestamptz)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
#variable_conflict use_column
DECLARE
    v_no integer;
BEGIN
    PERFORM bi.assert_may_work_on_v1(p_job);
    PERFORM 1 FROM bi.shards s
     WHERE s.job_version = p_job AND s.shard_no = p_shard AND bi.holds_lease_v1(s, p_epoch)
       FOR UPDATE;
    IF NOT FOUND THEN
        PERFORM bi.record_fence_v1(p_job, p_shard, 'hosted_open', p_epoch, p_worker);
        stale := true;
        RETURN;
    END IF;
    stale := false;
    UPDATE bi.hosted_batches h SET epoch = p_epoch
     WHERE h.job_version = p_job AND h.shard_no = p_shard AND h.state IN ('intent', 'submitted', 'ended')
       AND h.intent_no = (SELECT min(o.intent_no) FROM bi.hosted_batches o
                           WHERE o.job_version = p_job AND o.shard_no = p_shard
                             AND o.state IN ('intent', 'submitted', 'ended'))
    RETURNING h.intent_no, h.idem_key, h.provider_batch_id, h.state, h.record_ids, h.collected_epoch, h.created_at
         INTO intent_no, idem_key, provider_batch_id, state, record_ids, collected_epoch, created_at;
    IF FOUND THEN
        reattached := true;
        RETURN;
    END IF;
    SELECT coalesce(max(h.intent_no), 0) + 1 INTO v_no FROM bi.hosted_batches h
     WHERE h.job_version = p_job AND h.shard_no = p_shard;
    INSERT INTO bi.hosted_batches (job_version, shard_no, intent_no, idem_key, provider, epoch, record_ids)
    VALUES (p_job, p_shard, v_no,
            format('bi-%s-%s-%s-%s', substr(md5(p_job), 1, 12), p_shard, v_no, substr(md5(random()::text), 1, 12)),
            p_provider, p_epoch, p_ids)
    RETURNING bi.hosted_batches.intent_no, bi.hosted_batches.idem_key, bi.hosted_batches.provider_batch_id,
              bi.hosted_batches.state, bi.hosted_batches.record_ids, bi.hosted_batches.collected_epoch,
              bi.hosted_batches.created_at
         INTO intent_no, idem_key, provider_batch_id, state, record_ids, collected_epoch, created_at;
    reattached := false;
END $$;

-- The shard's unfinished provider batches (current epoch only).
CREATE OR REPLACE FUNCTION bi.hosted_intents_v1(p_job text, p_shard integer, p_epoch bigint)
RETURNS TABLE (intent_no integer, idem_key text, provider_batch_id text, input_ref text, state text,
               collected_epoch bigint, record_ids text[])
LANGUAGE plpgsql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
#variable_conflict use_column
BEGIN
    PERFORM bi.assert_may_work_on_v1(p_job);
    RETURN QUERY
    SELECT h.intent_no, h.idem_key, h.provider_batch_id, h.input_ref, h.state, h.collected_epoch, h.record_ids
      FROM bi.shards s
      JOIN bi.hosted_batches h ON h.job_version = s.job_version AND h.shard_no = s.shard_no
     WHERE s.job_version = p_job AND s.shard_no = p_shard AND bi.holds_lease_v1(s, p_epoch)
       AND h.state IN ('intent', 'submitted', 'ended')
     ORDER BY h.intent_no;
END $$;

-- One fenced update of a provider batch row: confirm (the provider's id and
-- input), poll (the mirrored counts), collected (results handed to the
-- worker, with usage), close (reconciled or abandoned). NULL arguments leave
-- a column as it is.
CREATE OR REPLACE FUNCTION bi.hosted_update_v1(p_job text, p_shard integer, p_epoch bigint, p_worker text,
                                             p_intent integer, p_op text, p_batch_id text DEFAULT NULL,
                                             p_input_ref text DEFAULT NULL, p_ids text[] DEFAULT NULL,
                                             p_status text DEFAULT NULL, p_counts integer[] DEFAULT NULL,
                                             p_ended boolean DEFAULT false, p_cancel boolean DEFAULT false,
                                             p_input_tokens bigint DEFAULT NULL,
                                             p_output_tokens bigint DEFAULT NULL,
                                             OUT stale boolean, OUT state text)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
#variable_conflict use_column
BEGIN
    PERFORM bi.assert_may_work_on_v1(p_job);
    IF p_op NOT IN ('confirm', 'poll', 'collected', 'reconciled', 'abandoned') THEN
        RAISE EXCEPTION 'unknown hosted batch operation %', p_op;
    END IF;
    UPDATE bi.hosted_batches h
       SET provider_batch_id = coalesce(p_batch_id, h.provider_batch_id),
           input_ref = coalesce(p_input_ref, h.input_ref),
           record_ids = coalesce(p_ids, h.record_ids),
           confirmed_at = CASE WHEN p_op = 'confirm' THEN coalesce(h.confirmed_at, clock_timestamp())
                               ELSE h.confirmed_at END,
           provider_status = coalesce(p_status, h.provider_status),
           total = coalesce(p_counts[1], h.total),
           processing = coalesce(p_counts[2], h.processing),
           succeeded = coalesce(p_counts[3], h.succeeded),
           errored = coalesce(p_counts[4], h.errored),
           canceled = coalesce(p_counts[5], h.canceled),
           expired = coalesce(p_counts[6], h.expired),
           polled_at = CASE WHEN p_op = 'poll' THEN clock_timestamp() ELSE h.polled_at END,
           cancel_requested_at = CASE WHEN p_cancel THEN coalesce(h.cancel_requested_at, clock_timestamp())
                                      ELSE h.cancel_requested_at END,
           ended_at = CASE WHEN p_ended THEN coalesce(h.ended_at, clock_timestamp()) ELSE h.ended_at END,
           collected_epoch = CASE WHEN p_op = 'collected' THEN p_epoch ELSE h.collected_epoch END,
           input_tokens = coalesce(p_input_tokens, h.input_tokens),
           output_tokens = coalesce(p_output_tokens, h.output_tokens),
           reconciled_at = CASE WHEN p_op IN ('reconciled', 'abandoned') THEN clock_timestamp()
                                ELSE h.reconciled_at END,
           state = CASE WHEN p_op = 'confirm' AND h.state = 'intent' THEN 'submitted'
                        WHEN p_ended AND h.state IN ('intent', 'submitted') THEN 'ended'
                        WHEN p_op IN ('reconciled', 'abandoned') THEN p_op
                        ELSE h.state END
      FROM bi.shards s
     WHERE h.job_version = p_job AND h.shard_no = p_shard AND h.intent_no = p_intent
       AND s.job_version = h.job_version AND s.shard_no = h.shard_no AND bi.holds_lease_v1(s, p_epoch)
    RETURNING h.state INTO state;
    stale := NOT FOUND;
    IF stale THEN
        PERFORM bi.record_fence_v1(p_job, p_shard, 'hosted_' || p_op, p_epoch, p_worker);
        state := NULL;
    END IF;
END $$;

-- The hosted term of the cutoff: over provider batches still in flight only
-- (the partial index), the requests they hold and those the provider reports
-- succeeded, which the ledger stores only once the batch ends. The cutoff
-- subtracts succeeded from outstanding. Its cost follows the batches in
-- flight, not the job's shards or records.
CREATE OR REPLACE FUNCTION bi.hosted_counts_v1(p_job text)
RETURNS TABLE (batches bigint, requests bigint, processing bigint, succeeded bigint, errored bigint)
LANGUAGE plpgsql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
#variable_conflict use_column
BEGIN
    PERFORM bi.assert_may_work_on_v1(p_job);
    RETURN QUERY
    SELECT count(*), coalesce(sum(h.total), 0), coalesce(sum(h.processing), 0),
           coalesce(sum(h.succeeded), 0), coalesce(sum(h.errored), 0)
      FROM bi.hosted_batches h
     WHERE h.job_version = p_job AND h.state IN ('intent', 'submitted');
END $$;

-- The hosted part of a job's bill and what its provider batches still hold: rows stored
-- through hosted batch and the providers' reported usage (the job's stripes), and the
-- requests of batches not yet ended (intent, submitted) with the succeeded ones of ended
-- batches not yet reconciled: paid for once they complete, so reserved under the budget.
-- p_lock: take the job's budget lock for the caller's transaction (a worker about to open
-- a provider batch holds it until its intent row, the reservation, is written).
CREATE OR REPLACE FUNCTION bi.hosted_spend_v1(p_job text, p_lock boolean,
                                            OUT rows bigint, OUT input_tokens bigint, OUT output_tokens bigint,
                                            OUT unpriced_batches bigint, OUT in_flight bigint)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM bi.assert_may_work_on_v1(p_job);
    IF p_lock THEN
        PERFORM pg_advisory_xact_lock(hashtextextended('bi.hosted_spend:' || p_job, 0));
    END IF;
    SELECT coalesce(sum(c.stored_hosted), 0)::bigint, sum(c.hosted_input_tokens)::bigint,
           sum(c.hosted_output_tokens)::bigint, coalesce(sum(c.hosted_unpriced), 0)::bigint
      INTO rows, input_tokens, output_tokens, unpriced_batches
      FROM bi.shard_stripes c WHERE c.job_version = p_job;
    SELECT coalesce(sum(CASE WHEN h.state = 'ended' THEN h.succeeded ELSE cardinality(h.record_ids) END), 0)::bigint
      INTO in_flight
      FROM bi.hosted_batches h
     WHERE h.job_version = p_job AND h.state IN ('intent', 'submitted', 'ended');
END $$;
