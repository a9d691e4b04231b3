-- The claim (distribution.md §3.3) walks claimable runs in run_id order. The pending ones come
-- from this index, one probe per candidate, so a claim never visits held runs; not_before is a
-- key column so the probe checks it in the index, without a heap visit.
CREATE INDEX runs_claim_order ON flyd.runs (run_id, not_before) WHERE state = 'pending';
