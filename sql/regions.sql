-- Named statements of batch_inference.regions: a job version placed over clusters in several regions
-- (sql/schema/regions.sql). Format as sql/queries.sql.

-- placement (the owner, at submit)

-- name: regions_placed  the clusters a version was placed on already, if any
SELECT cluster, region FROM bi.region_clusters WHERE job_version = %(job)s ORDER BY cluster;

-- name: regions_placed_settings  the clusters a version was placed on, with their settings (no secret)
SELECT cluster, region, settings FROM bi.region_clusters WHERE job_version = %(job)s ORDER BY cluster;

-- name: region_shards  the version's shards in number order, with their records, and its status
SELECT s.shard_no, s.records, j.status
  FROM bi.jobs j LEFT JOIN bi.shards s ON s.job_version = j.job_version
 WHERE j.job_version = %(job)s ORDER BY s.shard_no;

-- name: region_cluster_insert  one cluster of the version's deployment
INSERT INTO bi.region_clusters (job_version, cluster, region, settings)
VALUES (%(job)s, %(cluster)s, %(region)s, %(settings)s::jsonb);

-- name: region_egress_insert  the egress price from one region to another
INSERT INTO bi.region_egress (job_version, from_region, to_region, usd_per_gb)
VALUES (%(job)s, %(from_region)s, %(to_region)s, %(usd_per_gb)s);

-- name: replica_shard_rows  every record of one shard in record id byte order: what its replica holds
SELECT sr.record_id, sr.text FROM bi.snapshot_rows sr
 WHERE sr.job_version = %(job)s AND sr.shard_no = %(shard)s
 ORDER BY sr.record_id USING ~<~;

-- name: replica_insert  a shard's home region and its replica there, written once
INSERT INTO bi.replicas (job_version, shard_no, region, object_key, digest, bytes, records, seconds)
VALUES (%(job)s, %(shard)s, %(region)s, %(key)s, %(digest)s, %(bytes)s, %(records)s, %(seconds)s)
ON CONFLICT (job_version, shard_no) DO NOTHING;

-- name: region_replication_record  what writing one region's replicas cost (bytes, seconds, dollars)
-- home_region: the ledger's region, where the replicas were written from (usd: the bytes at its egress price).
INSERT INTO bi.region_decisions (job_version, kind, region, home_region, bytes, seconds, usd, reason)
VALUES (%(job)s, 'replicate', %(region)s, %(ledger_region)s, %(bytes)s, %(seconds)s, %(usd)s, %(reason)s);

-- a worker in a region

-- name: claim_shard_region  a pending or expired shard of this region first; with steal, one of a region that is behind
SELECT * FROM bi.claim_shard_region_v2(%(job)s, %(owner)s, %(transport)s, %(lease_s)s, %(region)s, %(steal)s);

-- name: region_store  the object store of a region's clusters (settings, no secret)
SELECT bi.region_store_v1(%(job)s, %(region)s) AS store;

-- name: region_shard_state  the leased shard's records with a result, a dead letter, a failed attempt or a crash
SELECT * FROM bi.region_shard_state_v1(%(job)s, %(shard)s, %(epoch)s);

-- name: replica_rows  every record of the leased shard, from the ledger, to rebuild its replica
SELECT * FROM bi.replica_rows_v1(%(job)s, %(shard)s, %(epoch)s);

-- name: replica_rebuilt  a replica found missing or not matching was written again from the ledger's rows
SELECT * FROM bi.replica_rebuilt_v1(%(job)s, %(shard)s, %(epoch)s, %(owner)s, %(region)s, %(reason)s,
                                    %(bytes)s, %(seconds)s);

-- name: hand_in_results  a far worker's results of the leased shard: a file in its region's store, merged near the ledger
SELECT * FROM bi.hand_in_results_v1(%(job)s, %(shard)s, %(epoch)s, %(owner)s, %(region)s, %(key)s, %(digest)s,
                                    %(records)s, %(bytes)s, %(transport)s, %(engine)s, %(endpoint)s);

-- name: renew_lease_held  a far worker's renewal with the results it holds for the shard (not yet in a file)
SELECT * FROM bi.renew_lease_held_v1(%(job)s, %(shard)s, %(epoch)s, %(owner)s, %(lease_s)s, %(held)s);

-- name: region_held  results far workers have done and the ledger has not stored yet (held under a current lease, or in a file not yet merged)
SELECT held FROM bi.region_held_v1(%(job)s);

-- the merge (the owner, near the ledger)

-- name: result_files_unmerged  handed-in result files not yet merged, oldest first, with their region's store
-- current: the file's epoch still holds the shard (else its merge is refused: no need to read it).
SELECT f.id, f.shard_no, f.epoch, f.region, f.object_key, f.digest, f.records,
       (SELECT c.settings -> 'store' FROM bi.region_clusters c
         WHERE c.job_version = f.job_version AND c.region = f.region ORDER BY c.cluster LIMIT 1) AS store,
       EXISTS (SELECT 1 FROM bi.shards s WHERE s.job_version = f.job_version AND s.shard_no = f.shard_no
                                            AND s.state = 'leased' AND s.epoch = f.epoch) AS current
  FROM bi.result_files f
 WHERE f.job_version = %(job)s AND f.merged_at IS NULL
 ORDER BY f.id LIMIT %(limit)s;

-- name: merge_result_file  one file's rows through the one put-if-absent and fence, then the shard's completion
-- The shard's held count goes with it (its epoch's results are in the ledger or refused).
WITH m AS (
    SELECT * FROM bi.merge_result_file_v1(%(file)s, %(ids)s::text[], %(outputs)s::text[]::jsonb[], %(categories)s::text[])
), held AS (
    DELETE FROM bi.held_results h USING bi.result_files f
     WHERE f.id = %(file)s AND h.job_version = f.job_version AND h.shard_no = f.shard_no AND h.epoch = f.epoch
)
SELECT * FROM m;

-- name: result_file_unreadable  a handed-in file missing or not matching its digest: nothing merged, the shard is done again
UPDATE bi.result_files SET merged_at = clock_timestamp(), merged_rows = 0, outcome = 'unreadable', detail = %(detail)s
 WHERE id = %(file)s AND merged_at IS NULL;

-- a region lost

-- name: region_stores  every region of a placed version with its store's settings (the first cluster's, by name)
SELECT DISTINCT ON (c.region) c.region, c.settings -> 'store' AS store
  FROM bi.region_clusters c WHERE c.job_version = %(job)s ORDER BY c.region, c.cluster;

-- name: end_region_leases  a region lost: the leases its workers hold end now, recorded (owner only)
SELECT bi.end_region_leases_v1(%(job)s, %(region)s, %(reason)s) AS ended;

-- reports

-- name: region_report  per region: shards homed, replica bytes and seconds, claims, steals in and their egress, rebuilds
SELECT r.region,
       count(*) AS shards, sum(r.bytes)::bigint AS replica_bytes, sum(r.seconds)::float8 AS replica_seconds,
       (SELECT count(*) FROM bi.region_decisions d
         WHERE d.job_version = %(job)s AND d.kind = 'claim' AND d.region = r.region) AS claims,
       (SELECT count(*) FROM bi.region_decisions d
         WHERE d.job_version = %(job)s AND d.kind = 'steal' AND d.region = r.region) AS steals_in,
       (SELECT coalesce(sum(d.bytes), 0)::bigint FROM bi.region_decisions d
         WHERE d.job_version = %(job)s AND d.kind = 'steal' AND d.region = r.region) AS egress_bytes,
       (SELECT coalesce(sum(d.usd), 0)::float8 FROM bi.region_decisions d
         WHERE d.job_version = %(job)s AND d.kind = 'steal' AND d.region = r.region) AS egress_usd,
       (SELECT count(*) FROM bi.region_decisions d
         WHERE d.job_version = %(job)s AND d.kind = 'rebuild' AND d.home_region = r.region) AS rebuilds
  FROM bi.replicas r WHERE r.job_version = %(job)s
 GROUP BY r.region ORDER BY r.region;

-- name: region_reads  every claim of the version: the shard, its epoch, where it was read and its home region
SELECT shard_no, epoch, kind, region, home_region, worker_id, bytes, usd, reason
  FROM bi.region_decisions WHERE job_version = %(job)s AND kind IN ('claim', 'steal') ORDER BY shard_no, epoch;

-- name: result_files_of_job  the version's handed-in result files and what their merge did
SELECT id, shard_no, epoch, worker_id, region, records, bytes, outcome, merged_rows, detail
  FROM bi.result_files WHERE job_version = %(job)s ORDER BY id;

-- name: region_bill  what the regions added to a placed version's bill: replication (bytes, seconds, dollars),
-- the steals' cross-region reads at the egress price, and the merge's reads of result files from far regions
-- (bytes at the egress price from the file's region to the ledger's); placed false for a version never placed.
WITH rep AS (
    SELECT count(*) AS regions, coalesce(sum(bytes), 0)::bigint AS bytes, coalesce(sum(seconds), 0)::float8 AS seconds,
           coalesce(sum(usd), 0)::float8 AS usd, min(home_region) AS ledger_region
      FROM bi.region_decisions WHERE job_version = %(job)s AND kind = 'replicate'
), steal AS (
    SELECT count(*) AS n, coalesce(sum(bytes), 0)::bigint AS bytes, coalesce(sum(usd), 0)::float8 AS usd
      FROM bi.region_decisions WHERE job_version = %(job)s AND kind = 'steal'
), merged AS (
    SELECT count(*) AS n, coalesce(sum(f.bytes), 0)::bigint AS bytes,
           coalesce(sum(f.bytes / 1e9 * e.usd_per_gb), 0)::float8 AS usd
      FROM bi.result_files f
      CROSS JOIN rep
      LEFT JOIN bi.region_egress e ON e.job_version = f.job_version AND e.from_region = f.region
                                  AND e.to_region = rep.ledger_region
     WHERE f.job_version = %(job)s AND f.outcome = 'merged' AND f.region <> rep.ledger_region
)
SELECT rep.regions > 0 AS placed, rep.ledger_region,
       rep.bytes AS replication_bytes, rep.seconds AS replication_seconds, rep.usd AS replication_usd,
       steal.n AS steals, steal.bytes AS steal_bytes, steal.usd AS steal_usd,
       merged.n AS merged_files, merged.bytes AS merge_bytes, merged.usd AS merge_usd
  FROM rep, steal, merged;
