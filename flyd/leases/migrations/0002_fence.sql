CREATE FUNCTION flyd.assert_fence(p_run bigint, p_epoch bigint, p_at_commit boolean DEFAULT false)
RETURNS void LANGUAGE plpgsql AS $$
DECLARE r flyd.runs%ROWTYPE; ok boolean;
BEGIN
  SELECT * INTO r FROM flyd.runs WHERE run_id = p_run FOR KEY SHARE;   -- held until tx end
  ok := FOUND AND r.lease_epoch = p_epoch
        AND ((r.state = 'running' AND r.lease_expires_at > flyd.app_now())
             -- at COMMIT only: this same transaction finished the run at this epoch
             OR (p_at_commit AND r.state IN ('succeeded', 'failed', 'cancelled')
                 AND current_setting('flyd.finished', true) = p_run || ':' || p_epoch));
  IF ok IS NOT TRUE THEN                 -- NULL counts as fenced
    RAISE EXCEPTION 'fenced: run % epoch % (live epoch %, state %)',
          p_run, p_epoch, r.lease_epoch, r.state USING ERRCODE = 'LF001';
  END IF;
END $$;

CREATE FUNCTION flyd.fence_row() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF NEW.lease_epoch = 0 AND TG_TABLE_NAME <> 'effects' THEN
    -- checkpoint/head imported at submit: only before the run's first grant
    PERFORM 1 FROM flyd.runs
     WHERE run_id = NEW.run_id AND lease_epoch = 0 AND state = 'pending' FOR KEY SHARE;
    IF NOT FOUND THEN
      RAISE EXCEPTION 'fenced: run % has been granted', NEW.run_id USING ERRCODE = 'LF001';
    END IF;
    RETURN NEW;
  END IF;
  IF TG_TABLE_NAME = 'run_heads' AND NEW.boundary < OLD.boundary THEN
    RAISE EXCEPTION 'high-water regression: run % boundary % -> %',
          NEW.run_id, OLD.boundary, NEW.boundary USING ERRCODE = 'LF002';
  END IF;
  PERFORM flyd.assert_fence(NEW.run_id, NEW.lease_epoch, TG_WHEN = 'AFTER');
  RETURN NEW;
END $$;

CREATE FUNCTION flyd.ledger_immutable() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF TG_OP = 'UPDATE' AND TG_TABLE_NAME = 'effects'
     AND (to_jsonb(NEW) - 'delivered') = (to_jsonb(OLD) - 'delivered') THEN
    RETURN NEW;                          -- only the delivery flag may change
  END IF;
  RAISE EXCEPTION '% on %.% is not allowed', TG_OP, TG_TABLE_SCHEMA, TG_TABLE_NAME
    USING ERRCODE = 'LF004';
END $$;

-- BEFORE: checked as the row is written; deferred AFTER: checked again at COMMIT.
CREATE TRIGGER effects_fence_now BEFORE INSERT ON flyd.effects
  FOR EACH ROW EXECUTE FUNCTION flyd.fence_row();
CREATE CONSTRAINT TRIGGER effects_fence_at_commit AFTER INSERT ON flyd.effects
  DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION flyd.fence_row();
CREATE TRIGGER effects_immutable BEFORE UPDATE OR DELETE ON flyd.effects
  FOR EACH ROW EXECUTE FUNCTION flyd.ledger_immutable();
CREATE TRIGGER checkpoints_fence_now BEFORE INSERT ON flyd.checkpoints
  FOR EACH ROW EXECUTE FUNCTION flyd.fence_row();
CREATE CONSTRAINT TRIGGER checkpoints_fence_at_commit AFTER INSERT ON flyd.checkpoints
  DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION flyd.fence_row();
CREATE TRIGGER checkpoints_immutable BEFORE UPDATE ON flyd.checkpoints
  FOR EACH ROW EXECUTE FUNCTION flyd.ledger_immutable();
CREATE TRIGGER run_heads_fence_now BEFORE UPDATE ON flyd.run_heads
  FOR EACH ROW EXECUTE FUNCTION flyd.fence_row();
CREATE CONSTRAINT TRIGGER run_heads_fence_at_commit AFTER UPDATE ON flyd.run_heads
  DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION flyd.fence_row();

CREATE FUNCTION flyd.finish_run(p_run bigint, p_epoch bigint, p_state flyd.run_state, p_outcome jsonb)
RETURNS text LANGUAGE plpgsql AS $$
BEGIN
  IF p_state NOT IN ('succeeded', 'failed', 'cancelled') THEN
    RAISE EXCEPTION 'not a terminal state: %', p_state USING ERRCODE = '22023';
  END IF;
  PERFORM 1 FROM flyd.runs WHERE run_id = p_run AND lease_epoch = p_epoch AND state = p_state;
  IF FOUND THEN RETURN 'already'; END IF;          -- standalone retry after an unknown outcome
  PERFORM flyd.assert_fence(p_run, p_epoch);
  UPDATE flyd.runs
     SET state = p_state, outcome = p_outcome, owner_node = NULL,
         lease_expires_at = NULL, finished_at = flyd.app_now()
   WHERE run_id = p_run AND lease_epoch = p_epoch;
  UPDATE flyd.run_attempts SET ended_at = flyd.app_now(), end_reason = 'finished'
   WHERE run_id = p_run AND lease_epoch = p_epoch;
  PERFORM set_config('flyd.finished', p_run || ':' || p_epoch, true);  -- for the commit-time fence
  RETURN 'finished';
END $$;

CREATE FUNCTION flyd.terminal_is_final() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF OLD.state IN ('succeeded', 'failed', 'cancelled')
     AND (NEW.state IS DISTINCT FROM OLD.state OR NEW.lease_epoch <> OLD.lease_epoch)
     AND coalesce(current_setting('flyd.intervention', true), '') <> 'on' THEN
    RAISE EXCEPTION 'run % is terminal (%)', OLD.run_id, OLD.state USING ERRCODE = 'LF003';
  END IF;
  RETURN NEW;
END $$;
CREATE TRIGGER runs_terminal_is_final BEFORE UPDATE ON flyd.runs
  FOR EACH ROW EXECUTE FUNCTION flyd.terminal_is_final();
