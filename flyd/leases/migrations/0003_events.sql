CREATE FUNCTION flyd.on_claimable() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF TG_OP = 'INSERT' THEN
    INSERT INTO flyd.run_heads (run_id) VALUES (NEW.run_id) ON CONFLICT DO NOTHING;
  END IF;
  PERFORM pg_notify('flyd_claimable', NEW.run_id::text);   -- delivered at commit
  RETURN NEW;
END $$;
CREATE TRIGGER runs_after_insert AFTER INSERT ON flyd.runs
  FOR EACH ROW EXECUTE FUNCTION flyd.on_claimable();
CREATE TRIGGER runs_after_requeue AFTER UPDATE OF state ON flyd.runs
  FOR EACH ROW WHEN (NEW.state = 'pending' AND OLD.state <> 'pending')
  EXECUTE FUNCTION flyd.on_claimable();
