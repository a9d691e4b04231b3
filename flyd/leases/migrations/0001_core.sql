CREATE TABLE flyd.sim_clock (            -- a row exists only in test databases
  only_row boolean PRIMARY KEY DEFAULT true CHECK (only_row),
  t        timestamptz NOT NULL
);
-- Every expiry decision uses this. Production: start time of the current statement.
CREATE FUNCTION flyd.app_now() RETURNS timestamptz LANGUAGE sql STABLE AS $$
  SELECT coalesce((SELECT t FROM flyd.sim_clock), statement_timestamp())
$$;

CREATE TYPE flyd.run_state AS ENUM ('pending', 'running', 'succeeded', 'failed', 'cancelled');

CREATE TABLE flyd.runs (
  run_id           bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
  submit_key       text UNIQUE,                       -- optional client idempotency key
  spec             jsonb          NOT NULL,           -- the run spec, canonical (session.md §4.10)
  state            flyd.run_state NOT NULL DEFAULT 'pending',
  lease_epoch      bigint         NOT NULL DEFAULT 0,  -- fencing token
  attempt          integer        NOT NULL DEFAULT 0 CHECK (attempt >= 0),
  max_attempts     integer        NOT NULL DEFAULT 3 CHECK (max_attempts > 0),
  owner_node       text,
  lease_expires_at timestamptz,
  not_before       timestamptz    NOT NULL DEFAULT '-infinity',
  cancel_requested boolean        NOT NULL DEFAULT false,
  faults_fired     text[]         NOT NULL DEFAULT '{}',  -- one-shot faults already fired (§3.11)
  outcome          jsonb,
  submitted_at     timestamptz    NOT NULL DEFAULT flyd.app_now(),
  finished_at      timestamptz,
  -- key column: changing it needs FOR UPDATE, which waits for fenced writers (§2.5)
  CONSTRAINT runs_epoch_key UNIQUE (run_id, lease_epoch),
  CONSTRAINT runs_lease_iff_running CHECK
    ((state = 'running') = (owner_node IS NOT NULL AND lease_expires_at IS NOT NULL)),
  CONSTRAINT runs_finished_iff_terminal CHECK
    ((state IN ('succeeded', 'failed', 'cancelled')) = (finished_at IS NOT NULL))
);
CREATE INDEX runs_claimable ON flyd.runs (not_before, run_id) WHERE state = 'pending';
CREATE INDEX runs_leased    ON flyd.runs (lease_expires_at)   WHERE state = 'running';
CREATE INDEX runs_by_owner  ON flyd.runs (owner_node)         WHERE state = 'running';

CREATE TABLE flyd.run_attempts (         -- append-only grant history
  run_id      bigint NOT NULL REFERENCES flyd.runs,
  lease_epoch bigint NOT NULL,
  node_id     text   NOT NULL,
  granted_at  timestamptz NOT NULL,
  ended_at    timestamptz,
  end_reason  text CHECK (end_reason IN ('expired', 'released', 'finished', 'exhausted', 'cancelled')),
  PRIMARY KEY (run_id, lease_epoch)
);

CREATE TABLE flyd.nodes (                -- registry for `flyctl status`; never used for leases
  node_id   text PRIMARY KEY,
  node_name text NOT NULL, host text NOT NULL, pid integer NOT NULL, version text NOT NULL,
  capacity  integer NOT NULL, held integer NOT NULL DEFAULT 0,
  state     text NOT NULL DEFAULT 'active' CHECK (state IN ('active', 'draining', 'stopped')),
  started_at   timestamptz NOT NULL DEFAULT flyd.app_now(),
  heartbeat_at timestamptz NOT NULL DEFAULT flyd.app_now()
);

CREATE TABLE flyd.checkpoints (          -- columns only; semantics: state.md §4
  run_id               bigint      NOT NULL REFERENCES flyd.runs,
  checkpoint_id        text        NOT NULL,
  lease_epoch          bigint      NOT NULL,   -- writer's fencing token (0 = imported at submit)
  node_id              text        NOT NULL,
  session_id           text        NOT NULL,
  session_epoch        bigint      NOT NULL,
  episode_id           text        NOT NULL,
  boundary             bigint      NOT NULL CHECK (boundary >= 0),
  compatibility_digest text        NOT NULL,
  envelope_digest      bytea       NOT NULL,   -- SHA-256 of envelope
  byte_length          bigint      NOT NULL,
  envelope             bytea       NOT NULL,   -- FLYSESS1 bytes
  committed_at         timestamptz NOT NULL DEFAULT flyd.app_now(),
  PRIMARY KEY (run_id, checkpoint_id)
);
ALTER TABLE flyd.checkpoints ALTER COLUMN envelope SET STORAGE EXTERNAL;

-- kept apart from runs: moving the head must not row-lock runs (heartbeats would queue behind it)
CREATE TABLE flyd.run_heads (
  run_id      bigint PRIMARY KEY REFERENCES flyd.runs,
  high_water  text,                        -- checkpoint_id; NULL = nothing committed
  boundary    bigint NOT NULL DEFAULT 0,
  lease_epoch bigint NOT NULL DEFAULT 0,   -- epoch of the last writer
  CONSTRAINT run_heads_high_water_fk FOREIGN KEY (run_id, high_water)
    REFERENCES flyd.checkpoints (run_id, checkpoint_id) DEFERRABLE INITIALLY DEFERRED
);

CREATE TABLE flyd.effects (              -- the ledger (§6)
  run_id         bigint      NOT NULL REFERENCES flyd.runs,
  effect_key     text        NOT NULL,     -- 'boundary-<k>' | 'finish'
  lease_epoch    bigint      NOT NULL,
  node_id        text        NOT NULL,
  session_epoch  bigint      NOT NULL,     -- N of the raw epoch e<N> that executed it; 'finish': last, 0 if none
  boundary       bigint,                   -- NULL for 'finish'
  checkpoint_id  text,                     -- covering checkpoint; NULL if committed with finish only
  payload        jsonb       NOT NULL,     -- rebased onto e1 (state.md §9.2)
  payload_digest bytea       NOT NULL,     -- SHA-256 of canonical JSON of payload
  recorded_at    timestamptz NOT NULL DEFAULT flyd.app_now(),
  delivered      boolean     NOT NULL DEFAULT false,   -- reserved for a later outbound dispatcher
  CONSTRAINT effects_pkey PRIMARY KEY (run_id, effect_key)
);

CREATE TABLE flyd.interventions (        -- every operator action that bypasses the protocol
  intervention_id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
  at timestamptz NOT NULL DEFAULT flyd.app_now(), actor text NOT NULL,
  kind text NOT NULL,                      -- v1: 'requeue' (failed -> pending)
  run_id bigint REFERENCES flyd.runs, detail jsonb
);
