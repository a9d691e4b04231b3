"""Leases, fencing and the effects ledger on PostgreSQL (distribution.md)."""
