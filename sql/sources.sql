-- Named statements that kind-sql sources (batch_inference.sources.sql) send to the engines they read,
-- not to the ledger: each goes through the Airflow connection's own DB-API driver. Their {placeholders}
-- are filled with str.format by that module with identifiers the engine's SQLAlchemy dialect quoted
-- (the spec allows plain identifiers only) and an ISO 8601 timestamp it checked.

-- name: source_select  a table's record columns (id, the record's columns, the ACL)
SELECT {columns} FROM {table}

-- name: source_check  the names of a statement resolved without reading a row (an unknown table or column is refused here)
SELECT * FROM ({statement}) bi_check WHERE 1 = 0

-- name: source_as_of_snowflake  a Snowflake table as it was at a time (time travel)
{table} AT(TIMESTAMP => {ts}::TIMESTAMP_TZ)

-- name: source_as_of_bigquery  a BigQuery table as it was at a time (time travel)
{table} FOR SYSTEM_TIME AS OF TIMESTAMP {ts}

-- name: source_mysql_snapshot  MySQL / MariaDB: start it now, consistent and read-only
START TRANSACTION WITH CONSISTENT SNAPSHOT, READ ONLY

-- name: source_sqlite_query_only  SQLite: this connection may not write
PRAGMA query_only = ON

-- name: source_sqlite_begin  SQLite: one read transaction (one snapshot) for the whole read
BEGIN

-- name: source_mysql_read_only_session  MySQL / MariaDB: every transaction of this session is read-only
SET SESSION TRANSACTION READ ONLY
