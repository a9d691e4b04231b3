-- What a boundary produced, for `flyctl runs export` (cli.md §7.2): world time, per-agent
-- rewards, task events and progress, ids rebased onto e1 like the payload. Written by the same
-- INSERT as the ledger row, so it is recorded exactly once with the effect; NULL on rows written
-- before this column (and on 'finish'). Not part of payload_digest: behaviour digests stay as
-- they were.
ALTER TABLE flyd.effects ADD COLUMN result jsonb;
