-- Why a node holds its claims (`flyctl status`, issue 34): a router or fork server of its own
-- that it could not bring back; NULL while the node claims. Status only, never used for leases.
ALTER TABLE flyd.nodes ADD COLUMN reason text;
