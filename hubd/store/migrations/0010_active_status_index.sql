-- 0010_active_status_index: the active rows' index carries their status, so the status counts
-- behind /metrics read it alone, in one plan at any table size (schema.sql says why).
DROP INDEX hubd_allocations_active_idx;
CREATE INDEX hubd_allocations_active_idx ON hubd_allocations (status, id)
    WHERE status IN ('pending', 'provisioning', 'allocated', 'replacing', 'releasing');
