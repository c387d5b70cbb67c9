-- 0015_publish_destinations: a publish or rollback records, beside its
-- history row, what each destination other than the view points at after it
-- (an Iceberg table's snapshot id and metadata file), and the ledger's
-- database gets a schema of its own for pyiceberg's SQL catalog
-- (batch_inference.destinations.iceberg). Never edited.

-- What a publish or rollback left each destination pointing at: for an
-- Iceberg table the snapshot its main branch names and the metadata file that
-- commit wrote. Written in the transaction that switches the view, so a
-- history row and its destinations appear together. No credentials: the
-- destination is named by kind, catalog name and table.
CREATE TABLE IF NOT EXISTS bi.publish_destinations (
    history_id  bigint NOT NULL REFERENCES bi.publish_history (id) ON DELETE CASCADE,
    destination text NOT NULL,              -- e.g. iceberg:ledger.analytics.ticket_triage
    job_version text NOT NULL,
    snapshot_id bigint,
    location    text,
    PRIMARY KEY (history_id, destination)
);
REVOKE ALL ON bi.publish_destinations FROM PUBLIC;

-- pyiceberg's SqlCatalog creates its own two tables (iceberg_tables,
-- iceberg_namespace_properties) here on first use.
CREATE SCHEMA IF NOT EXISTS iceberg_catalog;
REVOKE ALL ON SCHEMA iceberg_catalog FROM PUBLIC;
