-- The model ladder and the preview (batch_inference.ladder, batch_inference.estimate).
-- Not a migration: named statements loaded by batch_inference.db.queries();
-- every name starts with ladder_ or estimate_.

-- name: estimate_source_rows  every record of a PostgreSQL source as the submit reads it, for the preview (run in a read-only transaction, through a server-side cursor)
SELECT s.record_id, s.text, s.acl, s.reject FROM {relation} AS s;

-- name: estimate_recent_runs  the newest job versions of the same pinned model with batch results: rows, workers and the span from first to last write
SELECT j.job_version, r.n, r.workers, extract(epoch FROM r.last - r.first)::float8 AS seconds
  FROM (SELECT jb.job_version, jb.created_at FROM bi.jobs jb
         WHERE jb.model_name = %(model_name)s AND jb.model_digest = %(model_digest)s AND jb.status <> 'dropped'
         ORDER BY jb.created_at DESC LIMIT %(n)s) j
 CROSS JOIN LATERAL (SELECT count(*) AS n, count(DISTINCT x.worker_id) AS workers,
                            min(x.created_at) AS first, max(x.created_at) AS last
                       FROM bi.results x WHERE x.job_version = j.job_version AND x.transport = 'batch') r
 WHERE r.n >= %(min_rows)s AND r.last > r.first
 ORDER BY j.created_at DESC;

-- name: estimate_outputs  stored answers of a job version as text (their output tokens, by the pinned tokenizer)
SELECT x.output::text AS output FROM bi.results x WHERE x.job_version = %(job)s LIMIT %(n)s;

-- name: estimate_failed_attempts  failed attempts of a job version's records (a pilot's invalid answers)
SELECT coalesce(sum(a.attempts), 0)::bigint AS failed FROM bi.attempts a WHERE a.job_version = %(job)s;

-- name: estimate_pilot_insert  record a pilot's measured figures
INSERT INTO bi.estimate_pilots (dataset, spec_hash, model_name, model_digest, engine, records, stored, failed,
                                dead_letters, seconds, records_per_s, input_tokens, output_tokens, valid_rate)
VALUES (%(dataset)s, %(spec_hash)s, %(model_name)s, %(model_digest)s, %(engine)s, %(records)s, %(stored)s,
        %(failed)s, %(dead_letters)s, %(seconds)s, %(records_per_s)s, %(input_tokens)s, %(output_tokens)s,
        %(valid_rate)s)
RETURNING *;

-- name: estimate_pilot_latest  the newest pilot of the same pinned model and engine, one of the same spec first
SELECT p.* FROM bi.estimate_pilots p
 WHERE p.model_name = %(model_name)s AND p.model_digest = %(model_digest)s AND p.engine = %(engine)s
 ORDER BY (p.spec_hash = %(spec_hash)s) DESC, p.measured_at DESC
 LIMIT 1;

-- name: estimate_pilots_of_dataset  a dataset's newest pilots (the dashboard)
SELECT p.* FROM bi.estimate_pilots p WHERE p.dataset = %(dataset)s ORDER BY p.measured_at DESC LIMIT %(n)s;

-- name: estimate_preview_insert  record the preview a DAG run's estimate task made before its submit
INSERT INTO bi.estimate_previews (dag_id, run_id, dataset, spec_hash, verdict, figures)
VALUES (%(dag_id)s, %(run_id)s, %(dataset)s, %(spec_hash)s, %(verdict)s, %(figures)s)
RETURNING id, at;

-- name: estimate_previews_of_dataset  a dataset's newest previews (the dashboard)
SELECT v.id, v.dag_id, v.run_id, v.dataset, v.spec_hash, v.verdict, v.figures, v.at
  FROM bi.estimate_previews v WHERE v.dataset = %(dataset)s ORDER BY v.at DESC LIMIT %(n)s;

-- name: ladder_put_answers  put-if-absent rung answers of records of one shard under the lease (stale: epoch ended)
SELECT stale, n FROM bi.ladder_put_answers_v1(%(job)s, %(shard)s, %(epoch)s, %(owner)s, %(ids)s, %(rungs)s,
                                              %(outputs)s, %(valid)s, %(confidence)s, %(escalated)s, %(errors)s);

-- name: ladder_answers  the stored rung answers of some records of a shard the caller holds
SELECT record_id, rung, output, valid, confidence, escalated
  FROM bi.ladder_answers_v1(%(job)s, %(shard)s, %(epoch)s, %(ids)s);

-- name: ladder_rung_counts  per rung of a job version: records answered, kept as final, valid, mean confidence
SELECT a.rung::integer AS rung, count(*) AS answered, count(*) FILTER (WHERE NOT a.escalated) AS kept,
       count(*) FILTER (WHERE a.valid) AS valid, avg(a.confidence) AS mean_confidence
  FROM bi.ladder_answers a WHERE a.job_version = %(job)s GROUP BY a.rung ORDER BY a.rung;

-- name: ladder_record_calibration  keep what calibrate measured for a ladder spec
INSERT INTO bi.ladder_calibrations (dataset, spec_hash, target, thresholds, report)
VALUES (%(dataset)s, %(spec_hash)s, %(target)s, %(thresholds)s, %(report)s)
RETURNING id, calibrated_at;

-- name: ladder_calibration_of  the newest calibration of a job version's spec (by its dataset and spec hash)
SELECT c.id, c.target, c.thresholds, c.report, c.calibrated_by, c.calibrated_at
  FROM bi.jobs j JOIN bi.ladder_calibrations c ON c.dataset = j.dataset AND c.spec_hash = j.spec_hash
 WHERE j.job_version = %(job)s ORDER BY c.calibrated_at DESC LIMIT 1;

-- name: ladder_calibration_of_spec  the newest calibration of a ladder spec (its dataset and spec hash): the picked cascade, for the preview's bill
SELECT c.report -> 'picked' AS picked, c.report -> 'golden' AS golden, c.calibrated_at
  FROM bi.ladder_calibrations c WHERE c.dataset = %(dataset)s AND c.spec_hash = %(spec_hash)s
 ORDER BY c.calibrated_at DESC LIMIT 1;
