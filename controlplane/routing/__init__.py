"""Routing core shared by the simulator and the live router."""
