-- Named statements of the evaluation (batch_inference.evaluation): the golden
-- set, the review sample and the reviews. Loaded by db.q like every query file.

-- name: review_sample_store  the seeded random sample of stored results, with input text and ACL, kept for review (order-independent; idempotent)
INSERT INTO bi.review_sample (job_version, record_id, text, output, acl)
SELECT r.job_version, r.record_id, s.text, r.output, r.acl
  FROM (SELECT record_id FROM bi.results WHERE job_version = %(job)s
         ORDER BY hashtextextended(record_id, %(seed)s), record_id LIMIT %(n)s) pick
  JOIN bi.results r ON r.job_version = %(job)s AND r.record_id = pick.record_id
  JOIN bi.snapshot_rows s ON s.job_version = %(job)s AND s.record_id = pick.record_id
ON CONFLICT (job_version, record_id) DO NOTHING;

-- name: golden_rows  the golden set: id, text and expected output ({table}, {id}, {text}, {expected} composed)
SELECT {id}::text AS record_id, {text}::text AS text, {expected}::jsonb AS expected FROM {table} ORDER BY 1;

-- name: golden_in_snapshot  the golden records that are in the job's snapshot with the same text
SELECT g.record_id
  FROM unnest(%(ids)s::text[], %(texts)s::text[]) AS g(record_id, text)
  JOIN bi.snapshot_rows s ON s.job_version = %(job)s AND s.record_id = g.record_id AND s.text = g.text;

-- name: outputs_of  stored outputs of some records of a job version
SELECT record_id, output FROM bi.results WHERE job_version = %(job)s AND record_id = ANY(%(ids)s);

-- name: label_counts  rows per value of one top-level output field of a job version
SELECT output ->> %(field)s AS label, count(*) AS n FROM bi.results WHERE job_version = %(job)s GROUP BY 1;

-- name: review_rows  the review sample with each row's verdict (as the reader: row-level security filters it)
SELECT s.record_id, s.text, s.output, s.acl, r.verdict, r.comment, r.reviewer, r.reviewed_at
  FROM bi.review_sample s
  LEFT JOIN bi.reviews r ON r.job_version = s.job_version AND r.record_id = s.record_id
 WHERE s.job_version = %(job)s
 ORDER BY s.record_id
 LIMIT %(n)s;

-- name: review_visible  whether the current role sees this row of the review sample (run as the reader)
SELECT count(*) AS n FROM bi.review_sample WHERE job_version = %(job)s AND record_id = %(record)s;

-- name: record_review  one verdict on a row of the review sample (guarded: the row is in the sample)
SELECT * FROM bi.record_review_v1(%(job)s, %(record)s, %(verdict)s, %(comment)s, %(reviewer)s);

-- name: review_state  the review counts against the spec's gate, why it is not met (NULL: met), and the standing rejection (NULL: none)
SELECT st.*, bi.review_gate_problem_v1(%(job)s) AS problem, bi.standing_rejection_v1(%(job)s) AS rejection
  FROM bi.review_state_v1(%(job)s) st;

-- name: record_rejection  a reviewer's rejection of a whole version (guarded: the version exists; waits for a publish in flight)
SELECT * FROM bi.record_rejection_v1(%(job)s, %(reviewer)s, %(reason)s);

-- name: withdraw_rejections  withdraw a version's standing rejections, with who and why; how many
SELECT bi.withdraw_rejections_v1(%(job)s, %(actor)s, %(reason)s) AS n;

-- name: rejections  the rejections of the versions of a dataset (or of one version), newest first
SELECT rj.id, rj.job_version, rj.reviewer, rj.reason, rj.rejected_at, rj.withdrawn_by, rj.withdrawn_at,
       rj.withdraw_reason, rj.withdrawn_at IS NULL AS standing
  FROM bi.review_rejections rj JOIN bi.jobs j ON j.job_version = rj.job_version
 WHERE (%(job)s::text IS NULL OR rj.job_version = %(job)s) AND (%(dataset)s::text IS NULL OR j.dataset = %(dataset)s)
 ORDER BY rj.id DESC LIMIT %(n)s;

-- name: demo_labels_reset  the demo's golden set table (the sample tickets' expected labels), created if missing and emptied
CREATE TABLE IF NOT EXISTS {table} (id text PRIMARY KEY, text text NOT NULL, expected jsonb NOT NULL);
TRUNCATE {table};

-- name: demo_labels_copy  COPY target for the demo's golden set
COPY {table} (id, text, expected) FROM STDIN;

-- name: companion_link  record that a companion job version (the golden run, the judge) serves a version
INSERT INTO bi.companion_versions (job_version, companion, kind) VALUES (%(job)s, %(companion)s, %(kind)s)
ON CONFLICT (job_version, companion) DO NOTHING;
