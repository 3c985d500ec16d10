"""Engines as Ray Serve deployments: each replica runs the engine in process (docs/ray-serve.md).

asgi.py        an engine's own ASGI app called in process (head, then body chunks)
base.py        EngineServer: handle(), record_routing_stats(), KV-event follower, load time
deployment.py  engine_deployment(): the Serve options every engine deployment needs
sim.py         the simulated engine (controlplane.sim_replica) as a deployment
"""
