-- tiers: the tiered fallback's statements (batch_inference.tiers)

-- name: fallback_tier_put  the tier that answered some records of a shard, under the lease (stale: nothing written)
SELECT * FROM bi.fallback_tier_put_v1(%(job)s, %(shard)s, %(epoch)s, %(owner)s, %(ids)s::text[], %(tiers)s::text[]);

-- name: fallback_tier_rows  a job's rows stored by the fallback, per tier that answered them (only rows with a tier: the tail)
SELECT t.tier, count(*)::bigint AS rows
  FROM bi.fallback_tiers t
  JOIN bi.results r ON r.job_version = t.job_version AND r.record_id = t.record_id AND r.transport = 'fallback'
 WHERE t.job_version = %(job)s
 GROUP BY t.tier
 ORDER BY t.tier;
