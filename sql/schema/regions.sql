-- regions: a job version placed over clusters in several regions (batch_inference.regions).
--
-- Placement is deployment, not part of the job version: the same spec over the
-- same rows is the same version whether it runs in one region or in three. A
-- placed version has its clusters and the egress prices between their regions
-- (bi.region_clusters, bi.region_egress), one home region per shard with that
-- shard's replica there (bi.replicas: a content-addressed Parquet object in the
-- region's store, its sha256 recorded here), every claim recorded with where
-- it was read (bi.region_decisions: claim, steal priced as egress, rebuild of a
-- replica, replication cost) and the result files far workers hand in
-- (bi.result_files), merged by key near the ledger. Everything goes with its
-- job version (the foreign keys).

-- The clusters of a placed version: region, how workers start, GPU kind and
-- prices, capacity, object store (no secret: credentials come from the
-- environment or an Airflow connection at the store).
CREATE TABLE IF NOT EXISTS bi.region_clusters (
    job_version text NOT NULL REFERENCES bi.jobs (job_version) ON DELETE CASCADE,
    cluster     text NOT NULL,
    region      text NOT NULL,
    settings    jsonb NOT NULL,
    PRIMARY KEY (job_version, cluster)
);
CREATE INDEX IF NOT EXISTS region_clusters_region ON bi.region_clusters (job_version, region);

-- Dollars per GB read in from_region by a worker in to_region.
CREATE TABLE IF NOT EXISTS bi.region_egress (
    job_version text NOT NULL REFERENCES bi.jobs (job_version) ON DELETE CASCADE,
    from_region text NOT NULL,
    to_region   text NOT NULL,
    usd_per_gb  double precision NOT NULL CHECK (usd_per_gb >= 0),
    PRIMARY KEY (job_version, from_region, to_region),
    CHECK (from_region <> to_region)
);

-- Each shard's home region and its replica there: written once at placement,
-- its digest the sha256 of the object's bytes (the object's key names it too).
-- rebuilt counts replicas found missing or not matching and rebuilt from the
-- ledger's rows by a worker holding the shard.
CREATE TABLE IF NOT EXISTS bi.replicas (
    job_version text NOT NULL,
    shard_no    integer NOT NULL,
    region      text NOT NULL,
    object_key  text NOT NULL,
    digest      text NOT NULL CHECK (digest ~ '^[0-9a-f]{64}$'),
    bytes       bigint NOT NULL CHECK (bytes >= 0),
    records     integer NOT NULL CHECK (records >= 0),
    seconds     double precision NOT NULL CHECK (seconds >= 0),
    rebuilt     integer NOT NULL DEFAULT 0,
    written_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (job_version, shard_no),
    FOREIGN KEY (job_version, shard_no) REFERENCES bi.shards (job_version, shard_no) ON DELETE CASCADE
);
CREATE INDEX IF NOT EXISTS replicas_region ON bi.replicas (job_version, region, shard_no);

-- What the regions decided, one row each: a claim in the shard's home region,
-- a steal (a worker of another region took it; bytes read across priced at the
-- egress price), a replica rebuilt from the ledger, a region's replication
-- (bytes and seconds of writing its replicas), a region lost (the leases its
-- workers held ended at once, bi.end_region_leases_v1), a region's steal gate
-- opened or closed (bi.set_steal_gate_v1).
CREATE TABLE IF NOT EXISTS bi.region_decisions (
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    job_version text NOT NULL REFERENCES bi.jobs (job_version) ON DELETE CASCADE,
    kind        text NOT NULL CONSTRAINT region_decisions_kind_check
                CHECK (kind IN ('claim', 'steal', 'rebuild', 'replicate', 'region_lost', 'steal_gate')),
    shard_no    integer,
    epoch       bigint,
    region      text NOT NULL,          -- where the worker (or the replication) ran
    home_region text,                   -- the shard's home region
    worker_id   text,
    bytes       bigint NOT NULL DEFAULT 0,
    seconds     double precision NOT NULL DEFAULT 0,
    usd         double precision NOT NULL DEFAULT 0,
    reason      text,
    at          timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX IF NOT EXISTS region_decisions_job ON bi.region_decisions (job_version, kind, shard_no);

-- Whether workers of other regions may take a region's shards (its steal
-- gate): open when the deadline's arithmetic says its remaining records cannot
-- finish by the deadline with its own workers (the regions' autopilot,
-- regions.fleet.steal_gates; a region lost has none), closed otherwise. No row:
-- closed. bi.claim_shard_region_v2 steals only through an open gate.
CREATE TABLE IF NOT EXISTS bi.region_steal_gates (
    job_version text NOT NULL REFERENCES bi.jobs (job_version) ON DELETE CASCADE,
    home_region text NOT NULL,
    open        boolean NOT NULL,
    reason      text NOT NULL,
    decided_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (job_version, home_region)
);
REVOKE ALL ON bi.region_steal_gates FROM PUBLIC;

-- A far worker's results of one shard under one epoch: a Parquet file of keyed
-- rows (record_id, output, category) in its region's store, handed in with one
-- call (bi.hand_in_results_v1) and merged near the ledger by
-- bi.merge_result_file_v1 with the same put-if-absent and fence as every
-- other result write. outcome: merged (n new rows), already (merged before:
-- nothing done), stale (the epoch ended before the merge: refused, nothing
-- written), unreadable (the file was missing or did not match its digest:
-- nothing written; the shard's lease runs out and it is done again).
CREATE TABLE IF NOT EXISTS bi.result_files (
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    job_version text NOT NULL,
    shard_no    integer NOT NULL,
    epoch       bigint NOT NULL,
    worker_id   text NOT NULL,
    region      text NOT NULL,
    object_key  text NOT NULL,
    digest      text NOT NULL CHECK (digest ~ '^[0-9a-f]{64}$'),
    records     integer NOT NULL CHECK (records >= 0),
    bytes       bigint NOT NULL CHECK (bytes >= 0),
    transport   text NOT NULL,
    engine      text,
    endpoint    text,
    handed_in_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    merged_at   timestamptz,
    merged_rows integer,
    outcome     text CHECK (outcome IN ('merged', 'already', 'stale', 'unreadable')),
    detail      text,
    UNIQUE (job_version, shard_no, epoch),   -- one file per epoch (the same content may recur: one object)
    FOREIGN KEY (job_version, shard_no) REFERENCES bi.shards (job_version, shard_no) ON DELETE CASCADE
);
CREATE INDEX IF NOT EXISTS result_files_unmerged ON bi.result_files (job_version, id) WHERE merged_at IS NULL;

-- What a far worker holds: the results of its shard under its epoch that are
-- done and not yet in the ledger (they reach it in the shard's one file), as
-- its last renewal reported them (bi.renew_lease_held_v1). A row counts only
-- while its epoch holds the shard (bi.region_held_v1).
CREATE TABLE IF NOT EXISTS bi.held_results (
    job_version text NOT NULL,
    shard_no    integer NOT NULL,
    epoch       bigint NOT NULL,
    records     integer NOT NULL CHECK (records > 0),
    reported_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (job_version, shard_no),
    FOREIGN KEY (job_version, shard_no) REFERENCES bi.shards (job_version, shard_no) ON DELETE CASCADE
);
REVOKE ALL ON bi.held_results FROM PUBLIC;

-- Claim one shard from a worker in p_region: a pending or expired shard whose
-- replica is in p_region first; with p_steal, a shard of another region when
-- p_region has none left, that region's steal gate is open (the deadline's
-- arithmetic: its remaining records cannot finish by the deadline with its own
-- workers, bi.region_steal_gates) and it is behind (more of its shards
-- pending than its own workers hold: they will not reach them all this round,
-- or none of them is left). Everything else is every claim's: the job's mode
-- (bi.claimable_v1) and the one update (bi.lease_shard_v1: the epoch +1, the
-- lost lease and the deaths of an expired epoch's in-flight batch). The claim is recorded in
-- bi.region_decisions (a steal priced as egress: the replica's bytes at the
-- price from its home region to p_region). Answers also the replica to read:
-- its home region, key, digest and bytes, and whether the shard is untouched
-- (nothing stored or dead-lettered in it, no failed attempt or crash in the
-- job: every record of the replica is to do, nothing to ask the ledger). Shards of a version never placed
-- have no replica and are not claimed here.
CREATE OR REPLACE FUNCTION bi.claim_shard_region_v2(p_job text, p_owner text, p_transport text,
                                                   p_lease_seconds integer, p_region text, p_steal boolean)
RETURNS TABLE (shard_no integer, epoch bigint, lease_expires_at timestamptz, records integer, lost_leases integer,
               home_region text, object_key text, digest text, replica_bytes bigint, untouched boolean)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
#variable_conflict use_column
DECLARE
    p record;
    c record;
BEGIN
    PERFORM bi.assert_may_work_on_v1(p_job);
    IF NOT bi.claimable_v1(p_job, p_transport) THEN
        RETURN;
    END IF;
    WITH behind AS (
        SELECT r.region,
               count(*) FILTER (WHERE s.state = 'pending' OR s.lease_expires_at < clock_timestamp()) AS pending,
               count(*) FILTER (WHERE s.state = 'leased' AND s.lease_expires_at >= clock_timestamp()
                                  AND EXISTS (SELECT 1 FROM bi.region_decisions d
                                               WHERE d.job_version = s.job_version AND d.kind = 'claim'
                                                 AND d.shard_no = s.shard_no AND d.epoch = s.epoch)) AS leased
          FROM bi.replicas r JOIN bi.shards s ON s.job_version = r.job_version AND s.shard_no = r.shard_no
         WHERE p_steal AND r.job_version = p_job AND r.region <> p_region AND s.state <> 'done'
         GROUP BY r.region
    )
    SELECT s.shard_no, r.region AS home, r.object_key AS key, r.digest AS dig, r.bytes AS nbytes,
           b.pending AS home_pending, b.leased AS home_leased, g.reason AS gate_reason
      INTO p
      FROM bi.shards s
      JOIN bi.replicas r ON r.job_version = s.job_version AND r.shard_no = s.shard_no
      LEFT JOIN behind b ON b.region = r.region
      LEFT JOIN bi.region_steal_gates g ON g.job_version = p_job AND g.home_region = r.region AND g.open
     WHERE s.job_version = p_job
       AND (s.state = 'pending' OR (s.state = 'leased' AND s.lease_expires_at < clock_timestamp()))
       AND (r.region = p_region OR (p_steal AND g.open AND b.pending > b.leased))
     ORDER BY (r.region = p_region) DESC,   -- a steal takes the far end of the other region's range
              CASE WHEN r.region = p_region THEN s.shard_no ELSE -s.shard_no END
     LIMIT 1
       FOR UPDATE OF s SKIP LOCKED;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    SELECT * INTO c FROM bi.lease_shard_v1(p_job, p.shard_no, p_owner, p_transport, p_lease_seconds);
    INSERT INTO bi.region_decisions (job_version, kind, shard_no, epoch, region, home_region, worker_id, bytes,
                                     usd, reason)
    SELECT p_job, CASE WHEN p.home = p_region THEN 'claim' ELSE 'steal' END, c.shard_no, c.epoch, p_region, p.home,
           p_owner, CASE WHEN p.home = p_region THEN 0 ELSE p.nbytes END,
           CASE WHEN p.home = p_region THEN 0 ELSE p.nbytes / 1e9 * e.usd_per_gb END,
           CASE WHEN p.home <> p_region
                THEN left(format('%s had no shard left; %s had %s pending against %s held by its own workers; %s',
                                 p_region, p.home, p.home_pending, p.home_leased, p.gate_reason), 2000) END
      FROM (SELECT 1) one
      LEFT JOIN bi.region_egress e ON e.job_version = p_job AND e.from_region = p.home AND e.to_region = p_region;
    RETURN QUERY SELECT c.shard_no, c.epoch, c.lease_expires_at, c.records, c.lost_leases, p.home, p.key, p.dig,
                        p.nbytes, c.untouched;
END $$;

-- The object store of p_region's clusters (their settings' store; the first
-- cluster's, by name), for a worker of the version.
CREATE OR REPLACE FUNCTION bi.region_store_v1(p_job text, p_region text) RETURNS jsonb
LANGUAGE plpgsql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM bi.assert_may_work_on_v1(p_job);
    RETURN (SELECT c.settings -> 'store' FROM bi.region_clusters c
             WHERE c.job_version = p_job AND c.region = p_region ORDER BY c.cluster LIMIT 1);
END $$;

-- What the ledger knows of a leased shard's records besides their text: each
-- record with a result or a dead letter (done) or a failed attempt or a crash,
-- for the current epoch's holder only. A worker reading its shard from a
-- replica leaves out the done ones and carries the counts (an empty answer for
-- a fresh shard: nothing to probe).
CREATE OR REPLACE FUNCTION bi.region_shard_state_v1(p_job text, p_shard integer, p_epoch bigint)
RETURNS TABLE (record_id text, done boolean, attempts integer, crashes integer)
LANGUAGE plpgsql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
#variable_conflict use_column
DECLARE
    v_stored integer;
    v_dead integer;
BEGIN
    PERFORM bi.assert_may_work_on_v1(p_job);
    SELECT s.stored, s.dead INTO v_stored, v_dead
      FROM bi.shards s WHERE s.job_version = p_job AND s.shard_no = p_shard AND bi.holds_lease_v1(s, p_epoch);
    IF NOT FOUND THEN
        RETURN;
    END IF;
    IF v_stored = 0 AND v_dead = 0 AND NOT EXISTS (SELECT 1 FROM bi.attempts a WHERE a.job_version = p_job) THEN
        RETURN;
    END IF;
    RETURN QUERY
    SELECT sr.record_id,
           EXISTS (SELECT 1 FROM bi.results r WHERE r.job_version = p_job AND r.record_id = sr.record_id)
           OR EXISTS (SELECT 1 FROM bi.dead_letters d WHERE d.job_version = p_job AND d.record_id = sr.record_id),
           coalesce(a.attempts, 0), coalesce(a.crashes, 0)
      FROM bi.snapshot_rows sr
      LEFT JOIN bi.attempts a ON a.job_version = sr.job_version AND a.record_id = sr.record_id
     WHERE sr.job_version = p_job AND sr.shard_no = p_shard
       AND (a.record_id IS NOT NULL
            OR EXISTS (SELECT 1 FROM bi.results r WHERE r.job_version = p_job AND r.record_id = sr.record_id)
            OR EXISTS (SELECT 1 FROM bi.dead_letters d WHERE d.job_version = p_job AND d.record_id = sr.record_id));
END $$;

-- Every record of a leased shard (done or not), in record id byte order: what
-- the shard's replica holds, read from the ledger by the current epoch's
-- holder to rebuild a replica that was missing or did not match its digest.
CREATE OR REPLACE FUNCTION bi.replica_rows_v1(p_job text, p_shard integer, p_epoch bigint)
RETURNS TABLE (record_id text, text text)
LANGUAGE plpgsql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
#variable_conflict use_column
BEGIN
    PERFORM bi.assert_may_work_on_v1(p_job);
    IF NOT EXISTS (SELECT 1 FROM bi.shards s
                    WHERE s.job_version = p_job AND s.shard_no = p_shard AND bi.holds_lease_v1(s, p_epoch)) THEN
        RETURN;
    END IF;
    RETURN QUERY
    SELECT sr.record_id, sr.text FROM bi.snapshot_rows sr
     WHERE sr.job_version = p_job AND sr.shard_no = p_shard
     ORDER BY sr.record_id USING ~<~;
END $$;

-- A worker holding the shard found its replica missing or not matching its
-- digest and wrote it again from the ledger's rows (the same bytes: the digest
-- matched): recorded, under the lease.
CREATE OR REPLACE FUNCTION bi.replica_rebuilt_v1(p_job text, p_shard integer, p_epoch bigint, p_worker text,
                                               p_region text, p_reason text, p_bytes bigint, p_seconds double precision,
                                               OUT stale boolean)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM bi.assert_may_work_on_v1(p_job);
    PERFORM 1 FROM bi.shards s
     WHERE s.job_version = p_job AND s.shard_no = p_shard AND bi.holds_lease_v1(s, p_epoch);
    IF NOT FOUND THEN
        PERFORM bi.record_fence_v1(p_job, p_shard, 'replica_rebuilt', p_epoch, p_worker);
        stale := true;
        RETURN;
    END IF;
    UPDATE bi.replicas r SET rebuilt = r.rebuilt + 1 WHERE r.job_version = p_job AND r.shard_no = p_shard;
    INSERT INTO bi.region_decisions (job_version, kind, shard_no, epoch, region, home_region, worker_id, bytes,
                                     seconds, reason)
    SELECT p_job, 'rebuild', p_shard, p_epoch, p_region, r.region, p_worker, p_bytes, p_seconds, left(p_reason, 500)
      FROM bi.replicas r WHERE r.job_version = p_job AND r.shard_no = p_shard;
    stale := false;
END $$;

-- A far worker hands in a shard's results: the file's key, digest and size,
-- under the current epoch (a stale epoch is refused and recorded, nothing
-- written). The lease is extended by the job's lease length, so the merge near
-- the ledger (bi.merge_result_file_v1) finds this epoch still current. Handing
-- a file in again under the same epoch changes nothing (one file per epoch).
CREATE OR REPLACE FUNCTION bi.hand_in_results_v1(p_job text, p_shard integer, p_epoch bigint, p_worker text,
                                               p_region text, p_key text, p_digest text, p_records integer,
                                               p_bytes bigint, p_transport text, p_engine text, p_endpoint text,
                                               OUT stale boolean, OUT file_id bigint)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM bi.assert_may_work_on_v1(p_job);
    UPDATE bi.shards s
       SET lease_expires_at = clock_timestamp() + make_interval(secs =>
               (SELECT (j.spec ->> 'lease_seconds')::integer FROM bi.jobs j WHERE j.job_version = p_job)),
           lease_renewed_at = clock_timestamp()
     WHERE s.job_version = p_job AND s.shard_no = p_shard AND bi.holds_lease_v1(s, p_epoch);
    IF NOT FOUND THEN
        PERFORM bi.record_fence_v1(p_job, p_shard, 'hand_in_results', p_epoch, p_worker);
        stale := true;
        RETURN;
    END IF;
    INSERT INTO bi.result_files (job_version, shard_no, epoch, worker_id, region, object_key, digest, records, bytes,
                                 transport, engine, endpoint)
    VALUES (p_job, p_shard, p_epoch, p_worker, p_region, p_key, p_digest, p_records, p_bytes, p_transport, p_engine,
            p_endpoint)
    ON CONFLICT (job_version, shard_no, epoch) DO NOTHING
    RETURNING id INTO file_id;
    IF file_id IS NULL THEN
        SELECT f.id INTO file_id FROM bi.result_files f
         WHERE f.job_version = p_job AND f.shard_no = p_shard AND f.epoch = p_epoch;
    END IF;
    stale := false;
END $$;

-- Renew a far worker's lease (bi.renew_lease_v2, the one renewal) and record
-- how many results it holds for the shard: a count above 0 replaces the
-- shard's row, 0 removes it. A stale epoch records nothing.
CREATE OR REPLACE FUNCTION bi.renew_lease_held_v1(p_job text, p_shard integer, p_epoch bigint, p_worker text,
                                                 p_lease_seconds integer, p_held integer,
                                                 OUT stale boolean, OUT mode text, OUT lease_expires_at timestamptz)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM bi.assert_may_work_on_v1(p_job);
    SELECT r.stale, r.mode, r.lease_expires_at INTO stale, mode, lease_expires_at
      FROM bi.renew_lease_v2(p_job, p_shard, p_epoch, p_worker, p_lease_seconds) r;
    IF stale THEN
        RETURN;
    END IF;
    IF coalesce(p_held, 0) > 0 THEN
        INSERT INTO bi.held_results AS h (job_version, shard_no, epoch, records)
        VALUES (p_job, p_shard, p_epoch, p_held)
        ON CONFLICT (job_version, shard_no) DO UPDATE
           SET epoch = excluded.epoch, records = excluded.records, reported_at = excluded.reported_at;
    ELSE
        DELETE FROM bi.held_results h WHERE h.job_version = p_job AND h.shard_no = p_shard;
    END IF;
END $$;

-- The results far workers have done and the ledger has not stored yet: held
-- under a lease that is current (its epoch holds the shard and has not run
-- out), as the last renewal reported them, or handed in as a file not yet
-- merged (the larger of the two per shard). The cutoff counts them done (a
-- lease that runs out, or a region lost, takes them out at once; a drained
-- worker writes what it holds straight to the ledger), as the regions'
-- autopilot does. Its cost follows the shards far workers hold and the files
-- not yet merged.
CREATE OR REPLACE FUNCTION bi.region_held_v1(p_job text, OUT held bigint)
LANGUAGE plpgsql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM bi.assert_may_work_on_v1(p_job);
    SELECT coalesce(sum(x.records), 0)::bigint INTO held
      FROM (SELECT k.shard_no, max(k.records) AS records
              FROM (SELECT h.shard_no, h.epoch, h.records FROM bi.held_results h WHERE h.job_version = p_job
                    UNION ALL
                    SELECT f.shard_no, f.epoch, f.records FROM bi.result_files f
                     WHERE f.job_version = p_job AND f.merged_at IS NULL) k
              JOIN bi.shards s ON s.job_version = p_job AND s.shard_no = k.shard_no AND s.epoch = k.epoch
                              AND s.state = 'leased' AND s.lease_expires_at > clock_timestamp()
             GROUP BY k.shard_no) x;
END $$;

-- Merge one handed-in result file near the ledger (owner only): its rows go
-- through bi.put_results_v3 under the file's epoch and worker, the one
-- put-if-absent and fence of every result write; then the shard is completed
-- when every record is stored or dead-lettered (bi.complete_shard_v2). The
-- file row is locked first: a file merged before changes nothing (already), a
-- file whose epoch ended is refused (stale, a fence event recorded by the put)
-- and writes nothing.
CREATE OR REPLACE FUNCTION bi.merge_result_file_v1(p_file bigint, p_ids text[], p_outputs jsonb[],
                                                 p_categories text[], OUT outcome text, OUT n integer,
                                                 OUT done boolean)
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    f record;
    p record;
    c record;
    v_outcome text;
BEGIN
    SELECT * INTO f FROM bi.result_files r WHERE r.id = p_file FOR UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'no result file %', p_file USING ERRCODE = 'no_data_found';
    END IF;
    n := 0;
    done := false;
    IF f.merged_at IS NOT NULL THEN
        outcome := 'already';
        RETURN;
    END IF;
    SELECT * INTO p FROM bi.put_results_v3(f.job_version, f.shard_no, f.epoch, f.worker_id, f.transport, f.engine,
                                          f.endpoint, p_ids, p_outputs, p_categories);
    IF p.stale THEN
        v_outcome := 'stale';
    ELSE
        v_outcome := 'merged';
        n := p.n;
        SELECT * INTO c FROM bi.complete_shard_v2(f.job_version, f.shard_no, f.epoch, f.worker_id);
        done := coalesce(c.done, false);
    END IF;
    outcome := v_outcome;
    UPDATE bi.result_files r SET merged_at = clock_timestamp(), merged_rows = n, outcome = v_outcome
     WHERE r.id = p_file;
END $$;

-- A region is lost (its store or its Kubernetes API unreachable, its workers
-- gone at once): every lease its workers hold (the shard's current epoch was
-- claimed or stolen in p_region) ends now instead of when it runs out. Like a
-- release, not like a death: a lost region is no record's fault, so no crash
-- and no lost lease is counted, and a result file the region handed in and
-- that was not merged is refused unread from now on (its epoch does not hold
-- the shard). Recorded once with the shards it freed. Owner only. Returns how
-- many leases ended.
CREATE OR REPLACE FUNCTION bi.end_region_leases_v1(p_job text, p_region text, p_reason text) RETURNS integer
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v_shards integer[];
BEGIN
    WITH ended AS (
        UPDATE bi.shards s
           SET state = 'pending', lease_owner = NULL, lease_transport = NULL, lease_expires_at = NULL,
               in_flight = NULL
         WHERE s.job_version = p_job AND s.state = 'leased'
           AND EXISTS (SELECT 1 FROM bi.region_decisions d
                        WHERE d.job_version = s.job_version AND d.kind IN ('claim', 'steal')
                          AND d.shard_no = s.shard_no AND d.epoch = s.epoch AND d.region = p_region)
        RETURNING s.shard_no
    )
    SELECT array_agg(e.shard_no ORDER BY e.shard_no) INTO v_shards FROM ended e;
    INSERT INTO bi.region_decisions (job_version, kind, region, reason)
    VALUES (p_job, 'region_lost', p_region,
            left(format('%s; %s lease(s) ended: shards %s', p_reason, coalesce(cardinality(v_shards), 0),
                        coalesce(array_to_string(v_shards, ', '), 'none')), 2000));
    RETURN coalesce(cardinality(v_shards), 0);
END $$;

-- A region's steal gate set by the deadline's arithmetic (owner only): open or
-- closed with the sum that says so; a change of state is recorded as a
-- steal_gate decision. Returns whether the state changed.
CREATE OR REPLACE FUNCTION bi.set_steal_gate_v1(p_job text, p_region text, p_open boolean, p_reason text)
RETURNS boolean
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v_was boolean;
BEGIN
    SELECT g.open INTO v_was FROM bi.region_steal_gates g
     WHERE g.job_version = p_job AND g.home_region = p_region FOR UPDATE;
    INSERT INTO bi.region_steal_gates AS g (job_version, home_region, open, reason)
    VALUES (p_job, p_region, p_open, left(p_reason, 2000))
    ON CONFLICT (job_version, home_region) DO UPDATE
       SET open = excluded.open, reason = excluded.reason, decided_at = clock_timestamp();
    IF v_was IS NOT DISTINCT FROM p_open OR (v_was IS NULL AND NOT p_open) THEN
        RETURN false;
    END IF;
    INSERT INTO bi.region_decisions (job_version, kind, region, home_region, reason)
    VALUES (p_job, 'steal_gate', p_region, p_region,
            left(format('%s: %s', CASE WHEN p_open THEN 'open' ELSE 'closed' END, p_reason), 2000));
    RETURN true;
END $$;
