-- Request a sidecar, wait until it is ready, read where it serves, and release it, in psql:
--   psql "$(hubd db-url)" -v provisioner=local -v session=demo -f request.sql
-- The role needs only hubd_app (docs/api.md). psql cannot block on a notification, so this
-- script re-reads the view every 0.2 s (\watch, psql 17 or newer); a program LISTENs on
-- hubd_events instead (python.py, node/wait_ready.mjs).
\set ON_ERROR_STOP on
\if :{?provisioner}
\else
\set provisioner local
\endif
\if :{?session}
\else
\set session psql-example
\endif

SELECT id, status FROM hubd_v1.request(:'provisioner', session => :'session',
    spec => '{"example": "psql"}') \gset

\echo requested :id
-- Until the allocation is ready, or has ended (then the checks below fail the script).
SELECT status FROM hubd_v1.allocations
WHERE id = :'id' AND NOT ready AND status NOT IN ('releasing', 'released', 'failed', 'destroy_failed')
\watch interval=0.2 min_rows=1

SELECT ready, status, endpoint, metadata FROM hubd_v1.allocations WHERE id = :'id' \gset
\if :ready
\echo ready :id endpoint=:endpoint metadata=:metadata
\else
\echo not ready: :status
\quit 1
\endif

SELECT status AS after_release FROM hubd_v1.release(:'id', 'psql example done') \gset
\echo released :id :after_release
