"""Tenants and the router's fair queue (local, or shared in Redis)."""
