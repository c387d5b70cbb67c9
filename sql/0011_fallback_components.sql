-- 0011_fallback_components: a fallback run records each part of the overhead
-- it measured, so the cutoff relaxes its constants only on runs that measured
-- all of them (docs/deadlines.md, "Constants that go stale").
--
-- * drain_s: from the cutoff firing (jobs.fallback_at) to the moment no shard
--   was leased by a batch worker any more. Each shard stamps the end of its
--   batch lease (released, completed, abandoned, swept or taken over after
--   expiry) in batch_lease_ended_at; the run-recording query takes the latest
--   stamp, or 0 when every batch lease had ended before the cutoff fired.
-- * busy_s: the re-drive, the time at least one pool worker held a shard
--   (records / rate, stored rather than recomputed).
-- * load_s: the warehouse load, set by the publish step (fallback.add_load_time):
--   from nothing outstanding (finished_at) to the published pointer switch.
--
-- overhead_s stays what the pool measured (wall time minus busy_s); a run's
-- whole overhead is overhead_s + load_s. NULL means "not measured": rows
-- written before this migration have neither drain_s nor load_s, so they
-- are never complete and can only make the constants more conservative.

ALTER TABLE bi.fallback_runs
    ADD COLUMN IF NOT EXISTS drain_s double precision,   -- cutoff firing -> no batch lease left
    ADD COLUMN IF NOT EXISTS busy_s  double precision,   -- pool busy time (the re-drive)
    ADD COLUMN IF NOT EXISTS load_s  double precision;   -- nothing outstanding -> published pointer

UPDATE bi.fallback_runs SET busy_s = records / rate WHERE busy_s IS NULL AND rate > 0;

ALTER TABLE bi.shards ADD COLUMN IF NOT EXISTS batch_lease_ended_at timestamptz;

-- Stamp the end of a batch lease: the row was leased by a batch worker and is
-- now not (any state change, or a claim by the fallback pool).
CREATE OR REPLACE FUNCTION bi.stamp_batch_lease_end_v1() RETURNS trigger
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    NEW.batch_lease_ended_at := clock_timestamp();
    RETURN NEW;
END $$;

DROP TRIGGER IF EXISTS shards_batch_lease_end ON bi.shards;
CREATE TRIGGER shards_batch_lease_end BEFORE UPDATE OF state, lease_transport ON bi.shards
    FOR EACH ROW
    WHEN (OLD.state = 'leased' AND OLD.lease_transport = 'batch'
          AND (NEW.state <> 'leased' OR NEW.lease_transport IS DISTINCT FROM 'batch'))
    EXECUTE FUNCTION bi.stamp_batch_lease_end_v1();

-- Owner only: a trigger function is never called directly.
REVOKE EXECUTE ON FUNCTION bi.stamp_batch_lease_end_v1() FROM PUBLIC;
