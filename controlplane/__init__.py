"""Control plane for multi-replica vLLM fleets: routing, fairness, autoscaling, simulation."""

import os

# Nothing here uses BLAS; OpenBLAS worker threads would otherwise spin on the second core.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
