-- 0012_fewer_index_entries: three indexes that every write paid for and no statement of hubd's
-- needed (schema.sql says why). The ledger's primary key becomes (allocation_id, seq), the key
-- its reads already went by, and takes the place of the index on those columns; a ledger of
-- many rows is indexed again here once, under the migration's lock. A connection record's key
-- becomes its allocation, whose unique index it already had.
DROP INDEX hubd_allocations_status_idx;

ALTER TABLE hubd_allocation_ledger DROP CONSTRAINT hubd_allocation_ledger_pkey;
DROP INDEX hubd_allocation_ledger_allocation_idx;
ALTER TABLE hubd_allocation_ledger
    ADD CONSTRAINT hubd_allocation_ledger_pkey PRIMARY KEY (allocation_id, seq);

ALTER TABLE hubd_sidecar_connections DROP CONSTRAINT hubd_sidecar_connections_pkey;
ALTER TABLE hubd_sidecar_connections
    ADD CONSTRAINT hubd_sidecar_connections_pkey
    PRIMARY KEY USING INDEX hubd_sidecar_connections_allocation_idx;
