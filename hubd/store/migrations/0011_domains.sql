-- 0011_domains: the single-column rules become domains (schema.sql says why). The columns take
-- the domains first, bare, which changes no stored value, so no table is rewritten; then each
-- domain gets its rule, checked once against the rows already there, and the table constraints
-- it replaces go.
CREATE DOMAIN hubd_status AS text;
CREATE DOMAIN hubd_generation AS integer;
CREATE DOMAIN hubd_attempts AS integer;
CREATE DOMAIN hubd_spec AS jsonb;
CREATE DOMAIN hubd_sha256 AS bytea;
CREATE DOMAIN hubd_ledger_phase AS text;
CREATE DOMAIN hubd_error_code AS text;
CREATE DOMAIN hubd_ledger_message AS text;
CREATE DOMAIN hubd_duration_ms AS double precision;

-- A column named in a trigger's definition cannot change its type.
DROP TRIGGER hubd_allocations_socket_control ON hubd_allocations;

ALTER TABLE hubd_allocations
    DROP CONSTRAINT hubd_allocations_status_check,
    DROP CONSTRAINT hubd_allocations_generation_check,
    DROP CONSTRAINT hubd_allocations_attempts_check,
    DROP CONSTRAINT hubd_allocations_spec_check,
    DROP CONSTRAINT hubd_allocations_token_hash_check,
    ALTER COLUMN status DROP DEFAULT,
    ALTER COLUMN status TYPE hubd_status,
    ALTER COLUMN status SET DEFAULT 'pending',
    ALTER COLUMN generation DROP DEFAULT,
    ALTER COLUMN generation TYPE hubd_generation,
    ALTER COLUMN generation SET DEFAULT 1,
    ALTER COLUMN spec DROP DEFAULT,
    ALTER COLUMN spec TYPE hubd_spec,
    ALTER COLUMN spec SET DEFAULT '{}'::jsonb,
    ALTER COLUMN token_hash TYPE hubd_sha256,
    ALTER COLUMN ensure_attempts DROP DEFAULT,
    ALTER COLUMN ensure_attempts TYPE hubd_attempts,
    ALTER COLUMN ensure_attempts SET DEFAULT 0,
    ALTER COLUMN destroy_attempts DROP DEFAULT,
    ALTER COLUMN destroy_attempts TYPE hubd_attempts,
    ALTER COLUMN destroy_attempts SET DEFAULT 0;

ALTER TABLE hubd_allocation_ledger
    DROP CONSTRAINT hubd_allocation_ledger_phase_check,
    DROP CONSTRAINT hubd_allocation_ledger_generation_check,
    DROP CONSTRAINT hubd_allocation_ledger_code_check,
    DROP CONSTRAINT hubd_allocation_ledger_message_check,
    DROP CONSTRAINT hubd_allocation_ledger_duration_check,
    ALTER COLUMN generation TYPE hubd_generation,
    ALTER COLUMN phase TYPE hubd_ledger_phase,
    ALTER COLUMN error_code TYPE hubd_error_code,
    ALTER COLUMN message TYPE hubd_ledger_message,
    ALTER COLUMN duration_ms TYPE hubd_duration_ms;

ALTER TABLE hubd_sidecar_connections
    DROP CONSTRAINT hubd_sidecar_connections_generation_check,
    ALTER COLUMN generation TYPE hubd_generation;

ALTER TABLE hubd_sidecar_secrets
    DROP CONSTRAINT hubd_sidecar_secrets_generation_check,
    DROP CONSTRAINT hubd_sidecar_secrets_hash_check,
    ALTER COLUMN generation TYPE hubd_generation,
    ALTER COLUMN secret_hash TYPE hubd_sha256,
    ALTER COLUMN previous_hash TYPE hubd_sha256;

CREATE TRIGGER hubd_allocations_socket_control
    AFTER UPDATE OF generation, status ON hubd_allocations
    FOR EACH ROW
    WHEN (OLD.generation IS DISTINCT FROM NEW.generation
          OR (NEW.status IN ('released', 'failed', 'destroy_failed')
              AND OLD.status NOT IN ('released', 'failed', 'destroy_failed')))
    EXECUTE FUNCTION hubd_socket_control();

ALTER DOMAIN hubd_status ADD CONSTRAINT hubd_status_check CHECK (VALUE IN (
    'pending', 'provisioning', 'allocated', 'replacing', 'releasing',
    'released', 'failed', 'destroy_failed'));
ALTER DOMAIN hubd_generation ADD CONSTRAINT hubd_generation_check CHECK (VALUE >= 1);
ALTER DOMAIN hubd_attempts ADD CONSTRAINT hubd_attempts_check CHECK (VALUE >= 0);
ALTER DOMAIN hubd_spec ADD CONSTRAINT hubd_spec_check CHECK (jsonb_typeof(VALUE) = 'object');
ALTER DOMAIN hubd_sha256 ADD CONSTRAINT hubd_sha256_check CHECK (octet_length(VALUE) = 32);
ALTER DOMAIN hubd_ledger_phase ADD CONSTRAINT hubd_ledger_phase_check CHECK (
    VALUE IN ('intent', 'committed', 'failed', 'ambiguous'));
ALTER DOMAIN hubd_error_code ADD CONSTRAINT hubd_error_code_check CHECK (length(VALUE) <= 64);
ALTER DOMAIN hubd_ledger_message ADD CONSTRAINT hubd_ledger_message_check CHECK (
    length(VALUE) <= 500);
ALTER DOMAIN hubd_duration_ms ADD CONSTRAINT hubd_duration_ms_check CHECK (VALUE >= 0);
