"""Tenants: identity, the token-weighted fair queue and token quotas."""
