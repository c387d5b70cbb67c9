-- Embedding jobs (batch_inference.embed, sql/schema/embed.sql).
-- Not a migration: named statements loaded by batch_inference.db.queries();
-- every name starts with embed_.

-- name: embed_put_results  put-if-absent under the lease, each result with its float32 vector
SELECT * FROM bi.put_embeddings_v1(%(job)s, %(shard)s, %(epoch)s, %(owner)s, %(transport)s, %(engine)s,
                                   %(endpoint)s, %(ids)b::text[], %(outputs)b::text[]::jsonb[], %(vectors)b::bytea[]);

-- name: embed_scan  every stored vector of a version with who made it, for the validator's checks (streamed)
SELECT r.record_id, r.embedding, pg_column_size(r.embedding) AS bytes, r.engine, r.endpoint, r.transport
  FROM bi.results r WHERE r.job_version = %(job)s;

-- name: embed_vectors_of  the stored vectors of some records of a version
SELECT r.record_id, r.embedding FROM bi.results r
 WHERE r.job_version = %(job)s AND r.record_id = ANY (%(ids)s::text[]) AND r.embedding IS NOT NULL;

-- name: embed_shared_sample  records both versions embedded from the same content, a deterministic sample
SELECT a.record_id
  FROM bi.results a
  JOIN bi.results b ON b.job_version = %(base)s AND b.record_id = a.record_id
                   AND b.content_hash IS NOT DISTINCT FROM a.content_hash
 WHERE a.job_version = %(job)s AND a.embedding IS NOT NULL AND b.embedding IS NOT NULL
 ORDER BY md5(a.record_id), a.record_id
 LIMIT %(n)s;

-- name: embed_pairs  the golden pairs of an embedding job ({table}, {left}, {right}: the spec's evaluation.pairs)
SELECT {left}::text AS left_id, {right}::text AS right_id FROM {table} LIMIT %(n)s;

-- name: embed_pgvector  the schema pgvector is installed in (NULL: not installed)
SELECT bi.pgvector_schema_v1() AS schema;

-- name: embed_index_create  a version's search table, created empty once (bi.embed_index_create_v1)
SELECT bi.embed_index_create_v1(%(job)s, %(dims)s) AS table_name;

-- name: embed_index_rows  how many vectors a version's search table ({table}) holds
SELECT count(*) AS n FROM {table};

-- name: embed_index_source  a page of a version's stored vectors, in record id order after %(after)s
SELECT r.record_id, r.embedding FROM bi.results r
 WHERE r.job_version = %(job)s AND r.embedding IS NOT NULL AND (%(after)s::text IS NULL OR r.record_id > %(after)s)
 ORDER BY r.record_id
 LIMIT %(n)s;

-- name: embed_index_stage  the temporary table publish's copy stages vectors in (bi.embed_index_stage_v1)
SELECT bi.embed_index_stage_v1(%(dims)s);

-- name: embed_index_copy  vectors into the staging table, pgvector's binary form
COPY pg_temp.bi_embed_stage (record_id, embedding) FROM STDIN (FORMAT BINARY);

-- name: embed_index_fill  the staged vectors into the version's search table with their rows' ACL (bi.embed_index_fill_v1)
SELECT bi.embed_index_fill_v1(%(job)s) AS n;

-- name: embed_index_build  the HNSW index of a version's search table, built once (bi.embed_index_build_v1)
SELECT bi.embed_index_build_v1(%(job)s) AS index;

-- name: embed_ensure_view  the dataset's view reading one version's search table (bi.ensure_embedding_view_v1)
SELECT bi.ensure_embedding_view_v1(%(dataset)s, %(job)s, %(id_type)s, %(dims)s) AS view_name;

-- name: embed_index_drop  a dropped version's search table ({table}), if it had one
DROP TABLE IF EXISTS {table};
