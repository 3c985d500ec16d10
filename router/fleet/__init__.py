"""The live router's fleet: replicas, health, probes, the prefix index."""
