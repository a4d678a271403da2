-- Statements on hubd_provisioner_limits: what each provisioner's daemons allow. Written by a
-- daemon at its start; read by hubd_lifetime_deadline, hubd_idle_timeout, hubd_extend_allocation
-- and sweep_deadlines (sweeps.sql) in their own statements.

-- name: set_limits
-- The limits of provisioners :provisioner_ids[i]: :max_lifetimes[i], :pending_timeouts[i],
-- :idle_timeouts[i] and :provisioning_timeouts[i] seconds (NULL: none), as this daemon's
-- configuration says; the last daemon to start wins.
INSERT INTO hubd_provisioner_limits AS l (provisioner_id, max_lifetime, pending_timeout,
    idle_timeout, provisioning_timeout)
SELECT * FROM unnest(:provisioner_ids::text[], :max_lifetimes::float8[],
                     :pending_timeouts::float8[], :idle_timeouts::float8[],
                     :provisioning_timeouts::float8[])
ON CONFLICT (provisioner_id) DO UPDATE SET
    max_lifetime = EXCLUDED.max_lifetime,
    pending_timeout = EXCLUDED.pending_timeout,
    idle_timeout = EXCLUDED.idle_timeout,
    provisioning_timeout = EXCLUDED.provisioning_timeout,
    updated_at = now()
WHERE (l.max_lifetime, l.pending_timeout, l.idle_timeout, l.provisioning_timeout)
      IS DISTINCT FROM (EXCLUDED.max_lifetime, EXCLUDED.pending_timeout, EXCLUDED.idle_timeout,
                        EXCLUDED.provisioning_timeout);
