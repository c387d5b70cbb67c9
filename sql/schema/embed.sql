-- embed: embedding jobs (a spec's task: embed; batch_inference.embed).
--
-- A result of an embedding job is its bi.results row (the output is a small
-- object, {"dimensions", "norm"}) and its vector in bi.results.embedding:
-- float32 little-endian, 4 bytes a dimension, written in the same fenced
-- call (bi.put_embeddings_v1). Publishing copies the version's vectors into
-- bi.embed_<job_version>, a pgvector vector(n) column with an HNSW index,
-- built before the pointer moves; the dataset's view reads that table.

ALTER TABLE bi.results ADD COLUMN IF NOT EXISTS embedding bytea;

-- pgvector, where the server has it (the embedded PostgreSQL 18.6 ships 0.8.6).
-- Without it embedding jobs run, validate and keep their vectors; only their
-- publish is refused, with one line saying so (batch_inference.embed.index).
DO $$
DECLARE
    f regprocedure;
BEGIN
    IF EXISTS (SELECT 1 FROM pg_available_extensions WHERE name = 'vector') THEN
        CREATE EXTENSION IF NOT EXISTS vector;
        -- Its functions (the type's input, the <=> operator) as every extension's are: anyone may call
        -- them (this role's default privileges, roles.sql, would close them).
        FOR f IN SELECT d.objid::regprocedure FROM pg_depend d JOIN pg_extension e ON e.oid = d.refobjid
                  WHERE e.extname = 'vector' AND d.classid = 'pg_proc'::regclass AND d.deptype = 'e' LOOP
            EXECUTE format('GRANT EXECUTE ON FUNCTION %s TO PUBLIC', f);
        END LOOP;
    END IF;
EXCEPTION WHEN insufficient_privilege THEN
    RAISE NOTICE 'pgvector is available but this role may not create it: publishing embedding jobs needs it';
END $$;

-- Put-if-absent results with their vectors, under the current epoch: the
-- fenced write is bi.put_results_v3's (the same lock, guards and counts);
-- the vectors then go on the rows that call stored (a row is new exactly
-- when this worker and epoch wrote it and it has no vector yet).
CREATE OR REPLACE FUNCTION bi.put_embeddings_v1(p_job text, p_shard integer, p_epoch bigint, p_worker text,
                                               p_transport text, p_engine text, p_endpoint text, p_ids text[],
                                               p_outputs jsonb[], p_vectors bytea[],
                                               OUT stale boolean, OUT n integer)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM bi.assert_may_work_on_v1(p_job);
    IF cardinality(p_ids) IS DISTINCT FROM cardinality(p_vectors) THEN
        RAISE EXCEPTION 'put_embeddings: % ids but % vectors', cardinality(p_ids), cardinality(p_vectors)
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    SELECT r.stale, r.n INTO stale, n
      FROM bi.put_results_v3(p_job, p_shard, p_epoch, p_worker, p_transport, p_engine, p_endpoint, p_ids,
                             p_outputs, array_fill(NULL::text, ARRAY[cardinality(p_ids)])) r;
    IF stale OR n = 0 THEN
        RETURN;
    END IF;
    UPDATE bi.results r
       SET embedding = u.v
      FROM unnest(p_ids, p_vectors) AS u(id, v)
     WHERE r.job_version = p_job AND r.record_id = u.id AND r.embedding IS NULL
       AND r.worker_id = p_worker AND r.epoch = p_epoch;
END $$;

-- The schema pgvector is installed in, or NULL when it is not.
CREATE OR REPLACE FUNCTION bi.pgvector_schema_v1() RETURNS text
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT n.nspname::text FROM pg_extension e JOIN pg_namespace n ON n.oid = e.extnamespace
     WHERE e.extname = 'vector';
$$;

-- The search table of one version: bi.embed_<job_version>, what the dataset's view shows of each
-- result (its vector as vector(p_dims), ACL, transport, engine, time), so a nearest-neighbour query
-- is one ordered scan of its HNSW index. A reader (bi_reader) sees a row under the results' own
-- rule: the version is published, and the row's ACL holds one of the reader's principals (no ACL:
-- as the dataset's null_acl says). Created empty, once; returns its name.
CREATE OR REPLACE FUNCTION bi.embed_index_create_v1(p_job text, p_dims integer) RETURNS text
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v_schema text := bi.pgvector_schema_v1();
    v_table text := 'embed_' || p_job;
BEGIN
    IF v_schema IS NULL THEN
        RAISE EXCEPTION 'the pgvector extension is not installed in this database'
            USING ERRCODE = 'object_not_in_prerequisite_state';
    END IF;
    IF to_regclass(format('bi.%I', v_table)) IS NULL THEN
        EXECUTE format('CREATE TABLE bi.%I (record_id text PRIMARY KEY, embedding %I.vector(%s) NOT NULL, '
                       'acl text[], transport text NOT NULL, engine text, created_at timestamptz NOT NULL)',
                       v_table, v_schema, p_dims);
        EXECUTE format('ALTER TABLE bi.%I ENABLE ROW LEVEL SECURITY', v_table);
        EXECUTE format($policy$
            CREATE POLICY readable_result ON bi.%I FOR SELECT TO bi_reader
            USING (%L IN (SELECT p.job_version FROM bi.publish_pointer p)
                   AND CASE WHEN acl IS NULL THEN %L = ANY ((SELECT bi.null_acl_readable_jobs_v1())::text[])
                            ELSE acl && (SELECT bi.current_principals())
                       END)$policy$, v_table, p_job, p_job);
        EXECUTE format('REVOKE ALL ON bi.%I FROM PUBLIC', v_table);
        EXECUTE format('GRANT SELECT ON bi.%I TO bi_reader', v_table);
    END IF;
    RETURN format('bi.%I', v_table);
END $$;

-- Publish's copy, in one transaction: the stored vectors go (binary COPY) into a temporary table
-- (bi.embed_index_stage_v1), then into the version's search table with their rows' ACL, transport,
-- engine and time (bi.embed_index_fill_v1, which returns how many).
CREATE OR REPLACE FUNCTION bi.embed_index_stage_v1(p_dims integer) RETURNS void
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    EXECUTE format('CREATE TEMPORARY TABLE bi_embed_stage (record_id text, embedding %I.vector(%s)) '
                   'ON COMMIT DROP', bi.pgvector_schema_v1(), p_dims);
END $$;

CREATE OR REPLACE FUNCTION bi.embed_index_fill_v1(p_job text) RETURNS bigint
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    n bigint;
BEGIN
    EXECUTE format('INSERT INTO bi.%I (record_id, embedding, acl, transport, engine, created_at) '
                   'SELECT s.record_id, s.embedding, r.acl, r.transport, r.engine, r.created_at '
                   '  FROM pg_temp.bi_embed_stage s JOIN bi.results r ON r.job_version = %L '
                   '   AND r.record_id = s.record_id', 'embed_' || p_job, p_job);
    GET DIAGNOSTICS n = ROW_COUNT;
    RETURN n;
END $$;

-- The approximate (HNSW, cosine distance: the <=> operator) index of a version's search table,
-- built once, then the table's statistics. Returns the index's name.
CREATE OR REPLACE FUNCTION bi.embed_index_build_v1(p_job text) RETURNS text
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v_schema text := bi.pgvector_schema_v1();
    v_index text := 'embed_' || p_job || '_hnsw';
BEGIN
    IF to_regclass(format('bi.%I', v_index)) IS NULL THEN
        EXECUTE format('CREATE INDEX %I ON bi.%I USING hnsw (embedding %I.vector_cosine_ops)',
                       v_index, 'embed_' || p_job, v_schema);
        EXECUTE format('ANALYZE bi.%I', 'embed_' || p_job);
    END IF;
    RETURN format('bi.%I', v_index);
END $$;

-- The view of an embedding dataset: the version's search table (its row-level policy applies to
-- readers), embedding as vector(n). It names one version's table, so
-- it is created again in the transaction that moves the pointer to another version (a publish or a
-- rollback: the search moves with the pointer); it also shows nothing unless the pointer names
-- that version. Same version: no DDL.
CREATE OR REPLACE FUNCTION bi.ensure_embedding_view_v1(p_dataset text, p_job text, p_id_type text,
                                                      p_dims integer)
RETURNS text
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v_name text := format('published.%I', p_dataset);
    v_table text := format('bi.%I', 'embed_' || p_job);
    fields jsonb := jsonb_build_object('record_id', p_id_type, 'embedding', format('vector(%s)', p_dims),
                                       'search_table', v_table);
    v_job record;
BEGIN
    IF p_id_type NOT IN ('text', 'bigint', 'uuid') THEN
        RAISE EXCEPTION 'record_id type % is not one of text, bigint, uuid', p_id_type
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF to_regclass(v_table) IS NULL THEN
        RAISE EXCEPTION 'version % has no search table: publish builds it', p_job
            USING ERRCODE = 'object_not_in_prerequisite_state';
    END IF;
    IF to_regclass(v_name) IS NOT NULL
       AND (SELECT pv.fields FROM bi.published_views pv WHERE pv.dataset = p_dataset) = fields THEN
        RETURN v_name;
    END IF;
    EXECUTE format('DROP VIEW IF EXISTS %s', v_name);
    SELECT j.model_name, j.model_digest, j.prompt_version INTO v_job FROM bi.jobs j WHERE j.job_version = p_job;
    EXECUTE format(
        'CREATE VIEW published.%I WITH (security_invoker = true) AS '
        'SELECT e.record_id%s AS record_id, e.embedding, %L::text AS model_name, %L::text AS model_digest, '
        '%L::text AS prompt_version, e.transport, e.engine, %L::text AS job_version, e.created_at, e.acl '
        'FROM %s e WHERE %L = (SELECT p.job_version FROM bi.publish_pointer p WHERE p.dataset = %L)',
        p_dataset, CASE p_id_type WHEN 'text' THEN '' ELSE '::' || p_id_type END, v_job.model_name,
        v_job.model_digest, v_job.prompt_version, p_job, v_table, p_job, p_dataset);
    EXECUTE format('REVOKE ALL ON %s FROM PUBLIC', v_name);
    EXECUTE format('GRANT SELECT ON %s TO bi_reader', v_name);
    EXECUTE format('COMMENT ON VIEW %s IS %L', v_name,
                   format('Published embeddings of dataset %s: the version named in bi.publish_pointer, '
                          'searchable with the <=> operator (cosine distance, HNSW index). Rows are filtered '
                          'by ACL for bi_reader members.', p_dataset));
    INSERT INTO bi.published_views AS pv (dataset, view_name, fields) VALUES (p_dataset, v_name, fields)
    ON CONFLICT (dataset) DO UPDATE SET fields = excluded.fields;
    RETURN v_name;
END $$;
