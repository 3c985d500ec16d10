"""A simulated vLLM replica: `SimEngine` in real time behind vLLM's HTTP, metrics and KV-event
surfaces, with fault knobs. Run it with `controlplane sim-replica` (or
`python -m controlplane.sim_replica`).

    config.py        ReplicaConfig, KVEventsSettings (the CLI's options)
    tokenizer.py     the model directory's tokenizer, or the byte-level fallback
    blocks.py        vLLM block hashes <-> the engine's dense ids; engine events -> wire events
    engine_loop.py   EngineLoop: steps the engine in real time, follows live requests
    metrics.py       vLLM's Prometheus metrics on a private registry
    kv_publisher.py  ZMQ PUB + replay ROUTER, as vLLM's ZmqEventPublisher
    faults.py        the fault knobs (--fault, POST /_faults)
    protocol.py      OpenAI/vLLM request parsing, response and SSE shapes, ErrorInfo
    app.py           Replica (composition) and the Starlette app
    server.py        uvicorn, signals, the refuse-connections fault
"""

from controlplane.sim_replica.app import Replica, build_app
from controlplane.sim_replica.config import KVEventsSettings, ReplicaConfig
from controlplane.sim_replica.faults import Faults

__all__ = ["Faults", "KVEventsSettings", "Replica", "ReplicaConfig", "build_app"]
