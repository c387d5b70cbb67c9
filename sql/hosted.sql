-- Named statements of the hosted batch transports (batch_inference/hosted/):
-- their provider batches (sql/schema/hosted.sql), the cutoff's hosted term
-- and the hosted rows of the cost report.

-- name: hosted_open  open or re-attach to the shard's provider batch, fenced (stale true: our epoch ended)
SELECT * FROM bi.hosted_open_v1(%(job)s, %(shard)s, %(epoch)s, %(owner)s, %(provider)s, %(ids)s::text[]);

-- name: hosted_intents  the shard's unfinished provider batches (empty for a stale epoch)
SELECT * FROM bi.hosted_intents_v1(%(job)s, %(shard)s, %(epoch)s);

-- name: hosted_update  confirm, poll, collected, reconciled or abandoned: one fenced update of a provider batch row
SELECT * FROM bi.hosted_update_v1(%(job)s, %(shard)s, %(epoch)s, %(owner)s, %(intent)s, %(op)s, %(batch_id)s,
                                  %(input_ref)s, %(ids)s::text[], %(status)s, %(counts)s::integer[], %(ended)s,
                                  %(cancel)s, %(input_tokens)s, %(output_tokens)s);

-- name: hosted_counts  the cutoff's hosted term: requests and provider-succeeded counts of batches in flight
SELECT * FROM bi.hosted_counts_v1(%(job)s);

-- name: hosted_batches  one job's provider batches, for the CLI, the dashboard and the tests
SELECT shard_no, intent_no, idem_key, provider, epoch, provider_batch_id, input_ref, state, provider_status,
       total, processing, succeeded, errored, canceled, expired, collected_epoch, input_tokens, output_tokens,
       cardinality(record_ids) AS requests, created_at, confirmed_at, cancel_requested_at, ended_at, reconciled_at
  FROM bi.hosted_batches WHERE job_version = %(job)s ORDER BY shard_no, intent_no;

-- name: hosted_cost_rows  rows a job stored through hosted batch and the providers' reported usage, from the job's stripes (counters, never a scan of its results)
SELECT rows, input_tokens, output_tokens, unpriced_batches FROM bi.hosted_spend_v1(%(job)s, false);

-- name: hosted_spend  the hosted part of the bill and the requests the job's provider batches still hold (reserved under cost.budget); lock: hold the job's budget lock for this transaction
SELECT * FROM bi.hosted_spend_v1(%(job)s, %(lock)s);

-- name: hosted_drain  measured cancel drains of one job's provider batches: cancel request to settled, in seconds
SELECT shard_no, intent_no, extract(epoch FROM ended_at - cancel_requested_at)::float8 AS drain_s
  FROM bi.hosted_batches
 WHERE job_version = %(job)s AND cancel_requested_at IS NOT NULL AND ended_at IS NOT NULL
 ORDER BY shard_no, intent_no;
