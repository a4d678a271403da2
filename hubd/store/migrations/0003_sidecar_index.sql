-- 0003_sidecar_index: orphan collection asks, for every sidecar a provisioner reports, whether
-- it is the current sidecar of an active allocation; served without scanning history.
CREATE INDEX hubd_allocations_sidecar_idx ON hubd_allocations (sidecar_id)
    WHERE status IN ('pending', 'provisioning', 'allocated', 'replacing', 'releasing');
