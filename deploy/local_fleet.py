"""Start a local fleet of N replicas as subprocesses: the simulator or real vLLM (CPU build).

Each replica runs in its own process group (its own session; `deploy.processes`), so one
`killpg` reaches the server and everything it spawned (vLLM's EngineCore and worker processes).
Stopping sends SIGTERM to every group, waits up to `stop_grace_s` for the groups to empty, then
SIGKILLs what is left. Stopping happens on leaving the context manager, on Ctrl-C / SIGTERM in
the CLI, at interpreter exit (atexit), and, when started from the main thread, the kernel sends
the server SIGTERM if the launcher dies (PR_SET_PDEATHSIG).

Ports: replica i serves HTTP on ``base_port + i``; its KV-event PUB socket binds
``tcp://*:<event_base_port + 2i>`` and its replay ROUTER ``tcp://*:<event_base_port + 2i + 1>``
(``event_base_port`` defaults to ``base_port + 1000``; ``base_port=0`` picks free ports).
Subscribers connect to ``tcp://<host>:<port>``.

Command lines are built from `ReplicaLaunch` by `vllm_argv` / `sim_argv`; the flag names live in
those two functions and nowhere else.

Real vLLM needs `.venv-vllm` (`deploy.vllm_env`) and the tiny model (`deploy.tiny_model`); each
replica takes ~60-80 s to become healthy and holds ~3 GB RSS (vllm-interfaces.md §6).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from types import TracebackType
from typing import Literal

import httpx

from controlplane.errors import ConfigError, ControlPlaneError
from deploy.processes import Child, spawn

Engine = Literal["sim", "vllm"]
ENGINES: tuple[Engine, ...] = ("sim", "vllm")
Log = Callable[[str], None]
#: (launch) -> (argv, extra environment); replaces the engine's builder (tests, other servers)
ArgvFactory = Callable[["ReplicaLaunch"], tuple[list[str], dict[str, str]]]
VLLM_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
DEFAULT_TOPIC = "kv-events"


class FleetError(ControlPlaneError):
    """A replica failed to start, died, or the fleet could not be laid out."""


class ReplicaFailedError(FleetError):
    def __init__(self, name: str, message: str, log_tail: str = "") -> None:
        super().__init__(
            f"{name}: {message}" + (f"\n--- last log lines ---\n{log_tail}" if log_tail else "")
        )
        self.replica = name
        self.log_tail = log_tail


@dataclass(frozen=True)
class FleetSpec:
    """What to start. Defaults give the CPU test fleet of vllm-interfaces.md §6."""

    replicas: int = 2
    engine: Engine = "sim"
    host: str = "127.0.0.1"
    base_port: int = 8100  # 0 = pick free ports
    event_base_port: int | None = None  # default base_port + 1000
    model_dir: Path | None = None  # default: the tiny model's default dir (made if missing)
    model_name: str = "tiny-llama"
    block_size: int = 32
    max_model_len: int = 1024
    max_num_seqs: int = 64
    kv_cache_gib: int = 1  # vLLM CPU: VLLM_CPU_KVCACHE_SPACE
    num_gpu_blocks: int | None = None  # vLLM: --num-gpu-blocks-override; sim: --num-gpu-blocks
    speed: float = 1.0  # sim only
    load_time_s: float = 0.0  # sim only: seconds before a replica listens (vLLM loading)
    sim_gpu: str = "cpu"  # sim only: the roofline profile its step times follow
    sim_model: str = "tiny-llama"
    topic: str = DEFAULT_TOPIC
    kv_events: bool = True
    python_hash_seed: str = "0"
    cpu_bind: Literal["spread", "auto", "nobind"] = "spread"
    vllm_venv: Path | None = None  # default: deploy.vllm_env.default_venv()
    log_dir: Path | None = None  # default: a fresh temporary directory
    extra_args: tuple[str, ...] = ()
    extra_env: tuple[tuple[str, str], ...] = ()
    startup_timeout_s: float = 300.0
    # a replica whose process exits before its first /health 200 is started again this many
    # times (its log keeps every attempt); 0 = fail at once
    startup_retries: int = 1
    stop_grace_s: float = 15.0

    def validate(self) -> None:
        if self.engine not in ENGINES:
            raise ConfigError(f"engine must be one of {ENGINES}, got {self.engine!r}")
        if self.replicas < 1:
            raise ConfigError("replicas must be >= 1")
        if self.block_size < 1 or (self.engine == "vllm" and self.block_size % 32):
            raise ConfigError(
                f"block size {self.block_size}: vLLM's CPU backend needs a multiple of 32"
            )
        if self.kv_cache_gib < 1:
            raise ConfigError("kv_cache_gib must be a whole number of GiB >= 1")
        if self.startup_retries < 0:
            raise ConfigError("startup_retries must be >= 0")
        if self.base_port < 0 or self.base_port + self.replicas > 65535:
            raise ConfigError(f"bad base port {self.base_port}")


@dataclass(frozen=True)
class ReplicaLaunch:
    """One replica's resolved layout: everything the argv builders need."""

    index: int
    name: str
    host: str
    port: int
    events_port: int
    replay_port: int
    spec: FleetSpec
    model_dir: Path

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def events_bind(self) -> str:
        return f"tcp://*:{self.events_port}"

    @property
    def replay_bind(self) -> str:
        return f"tcp://*:{self.replay_port}"

    @property
    def events_connect(self) -> str:
        return f"tcp://{self.host}:{self.events_port}"

    @property
    def replay_connect(self) -> str:
        return f"tcp://{self.host}:{self.replay_port}"


def vllm_argv(r: ReplicaLaunch, python: Path) -> list[str]:
    s = r.spec
    argv = [
        str(python), "-m", VLLM_SERVER_MODULE,
        "--model", str(r.model_dir),
        "--served-model-name", s.model_name,
        "--host", r.host,
        "--port", str(r.port),
        "--block-size", str(s.block_size),
        "--max-model-len", str(s.max_model_len),
        "--max-num-seqs", str(s.max_num_seqs),
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",
        "--enable-force-include-usage",
        "--enable-request-id-headers",
        "--disable-uvicorn-access-log",
    ]  # fmt: skip
    if s.num_gpu_blocks:
        argv += ["--num-gpu-blocks-override", str(s.num_gpu_blocks)]
    if s.kv_events:
        cfg = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": r.events_bind,
            "replay_endpoint": r.replay_bind,
            "topic": s.topic,
        }
        argv += ["--kv-events-config", json.dumps(cfg, separators=(",", ":"))]
    return argv + list(s.extra_args)


def vllm_env(r: ReplicaLaunch) -> dict[str, str]:
    s = r.spec
    env = {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "PYTHONHASHSEED": s.python_hash_seed,
        "VLLM_CPU_KVCACHE_SPACE": str(s.kv_cache_gib),
    }
    if s.cpu_bind == "spread":
        # vLLM's "auto" binds every replica's OpenMP threads to the same core: spread them
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(r.index % (os.cpu_count() or 1))
    else:
        env["VLLM_CPU_OMP_THREADS_BIND"] = s.cpu_bind
    return env


def _controlplane_cmd() -> list[str]:
    script = Path(sys.executable).with_name("controlplane")
    if script.exists():
        return [str(script)]
    return [sys.executable, "-c", "from controlplane.cli import main; main()"]


def sim_argv(r: ReplicaLaunch) -> list[str]:
    s = r.spec
    argv = [
        *_controlplane_cmd(), "sim-replica",
        "--host", r.host,
        "--port", str(r.port),
        "--model-name", s.model_name,
        "--model-dir", str(r.model_dir),
        "--gpu", s.sim_gpu,
        "--model", s.sim_model,
        "--block-size", str(s.block_size),
        "--max-num-seqs", str(s.max_num_seqs),
        "--max-model-len", str(s.max_model_len),
        "--speed", str(s.speed),
    ]  # fmt: skip
    if s.num_gpu_blocks:
        argv += ["--num-gpu-blocks", str(s.num_gpu_blocks)]
    if s.load_time_s > 0:
        argv += ["--load-time-s", str(s.load_time_s)]
    if s.kv_events:
        argv += [
            "--kv-events-endpoint", r.events_bind,
            "--kv-events-replay-endpoint", r.replay_bind,
            "--kv-events-topic", s.topic,
        ]  # fmt: skip
    return argv + list(s.extra_args)


def sim_env(r: ReplicaLaunch) -> dict[str, str]:
    return {"PYTHONHASHSEED": r.spec.python_hash_seed}


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """`n` distinct ports the OS says are free right now (racy, but fine for local tests)."""
    socks: list[socket.socket] = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host if host != "0.0.0.0" else "", port))
        except OSError:
            return True
    return False


def layout(spec: FleetSpec, model_dir: Path) -> list[ReplicaLaunch]:
    n = spec.replicas
    if spec.base_port == 0:
        ports = free_ports(3 * n, spec.host)
        http, ev = ports[:n], ports[n:]
    else:
        http = [spec.base_port + i for i in range(n)]
        eb = spec.event_base_port if spec.event_base_port is not None else spec.base_port + 1000
        ev = [eb + j for j in range(2 * n)]
        taken = [p for p in (*http, *(ev if spec.kv_events else ())) if port_in_use(p, spec.host)]
        if taken:
            raise FleetError(f"ports already in use: {taken} (pick another --base-port)")
    return [
        ReplicaLaunch(
            index=i,
            name=f"replica-{i}",
            host=spec.host,
            port=http[i],
            events_port=ev[2 * i],
            replay_port=ev[2 * i + 1],
            spec=spec,
            model_dir=model_dir,
        )
        for i in range(n)
    ]


# --------------------------------------------------------------------------------------------
# replicas


def _tail(path: Path, lines: int = 30) -> str:
    try:
        with path.open("rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - 16384))
            text = fh.read().decode("utf-8", "replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


_ERROR_LINE = re.compile(r"\b(ERROR|CRITICAL)\b|Error:|Exception:|Killed|out of memory", re.I)


def _error_lines(path: Path, limit: int = 25, max_bytes: int = 4 << 20) -> str:
    """The log's error lines from anywhere in it (vLLM prints an engine's root cause far above
    the last lines, which only say "See root cause above")."""
    try:
        with path.open("rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - max_bytes))
            text = fh.read().decode("utf-8", "replace")
    except OSError:
        return ""
    hits = [line for line in text.splitlines() if _ERROR_LINE.search(line)]
    return "\n".join(hits[:limit])


@dataclass
class Replica:
    launch: ReplicaLaunch
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    child: Child | None = None
    started_at: float = 0.0
    healthy_at: float | None = None
    stopping: bool = False
    startup_failures: int = 0

    @property
    def name(self) -> str:
        return self.launch.name

    @property
    def url(self) -> str:
        return self.launch.url

    @property
    def pid(self) -> int | None:
        return self.child.pid if self.child else None

    @property
    def startup_s(self) -> float | None:
        return None if self.healthy_at is None else self.healthy_at - self.started_at

    def exited(self) -> int | None:
        return None if self.child is None else self.child.poll()

    def log_tail(self, lines: int = 30) -> str:
        tail = _tail(self.log_path, lines)
        errors = _error_lines(self.log_path)
        if not errors:
            return tail
        return f"{tail}\n--- error lines (whole log) ---\n{errors}"

    def describe(self) -> dict[str, object]:
        r = self.launch
        return {
            "name": r.name,
            "url": r.url,
            "kv_events_endpoint": r.events_connect if r.spec.kv_events else None,
            "kv_events_replay_endpoint": r.replay_connect if r.spec.kv_events else None,
            "kv_events_topic": r.spec.topic if r.spec.kv_events else None,
            "pid": self.pid,
            "log": str(self.log_path),
            "startup_s": None if self.startup_s is None else round(self.startup_s, 1),
        }


class LocalFleet:
    """N replica subprocesses. Use as a context manager (sync or async) or call start/stop.

    >>> with LocalFleet(FleetSpec(replicas=2, engine="vllm")) as fleet:   # doctest: +SKIP
    ...     urls = fleet.urls
    """

    def __init__(
        self, spec: FleetSpec, *, log: Log | None = None, argv_factory: ArgvFactory | None = None
    ) -> None:
        spec.validate()
        self.spec = spec
        self._argv_factory = argv_factory
        self._log: Log = log or (lambda _msg: None)
        self.replicas: list[Replica] = []
        self._owns_log_dir = False
        self.log_dir: Path | None = None
        self._lock = threading.Lock()
        self._stopped = False
        self.started_at = 0.0
        self.healthy_at: float | None = None

    # -- layout -------------------------------------------------------------------------------

    def _prepare(self) -> None:
        from deploy.tiny_model import default_model_dir, make_tiny_model

        spec = self.spec
        model_dir = spec.model_dir or default_model_dir()
        if spec.model_dir is None:
            make_tiny_model(model_dir)  # idempotent; the default dir is ours to (re)make
        elif not (model_dir / "config.json").is_file():
            raise FleetError(f"{model_dir} is not a model directory (no config.json)")
        model_dir = model_dir.resolve()
        python: Path | None = None
        if spec.engine == "vllm" and self._argv_factory is None:
            from deploy.vllm_env import require_vllm_env

            python = require_vllm_env(spec.vllm_venv).python
        if spec.log_dir is None:
            self.log_dir = Path(tempfile.mkdtemp(prefix="local-fleet-"))
            self._owns_log_dir = True
        else:
            self.log_dir = spec.log_dir.resolve()
            self.log_dir.mkdir(parents=True, exist_ok=True)
        base_env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
        for launch in layout(spec, model_dir):
            if self._argv_factory is not None:
                argv, extra = self._argv_factory(launch)
            elif spec.engine == "vllm":
                assert python is not None
                argv, extra = vllm_argv(launch, python), vllm_env(launch)
            else:
                argv, extra = sim_argv(launch), sim_env(launch)
            env = {**base_env, **extra, **dict(spec.extra_env)}
            self.replicas.append(Replica(launch, argv, env, self.log_dir / f"{launch.name}.log"))

    # -- lifecycle ----------------------------------------------------------------------------

    def launch(self) -> None:
        """Start every replica process (does not wait for health)."""
        if self.replicas:
            raise FleetError("this fleet was already started")
        self._prepare()
        assert self.log_dir is not None
        atexit.register(self.stop)
        self.started_at = time.monotonic()
        try:
            for rep in self.replicas:
                self._spawn(rep)
        except BaseException:
            self.stop()
            raise

    def _spawn(self, rep: Replica, mode: str = "wb") -> None:
        with rep.log_path.open(mode) as logf:
            logf.write(f"$ {' '.join(rep.argv)}\n".encode())
            logf.flush()
            rep.child = spawn(
                rep.argv,
                env=rep.env,
                cwd=self.log_dir,
                stdout=logf,
                stderr=subprocess.STDOUT,
                die_with_parent=True,
            )
        rep.started_at = time.monotonic()
        rep.healthy_at = None
        rep.stopping = False
        self._log(f"{rep.name}: pid {rep.pid}, log {rep.log_path}")

    def restart(self, index: int, timeout_s: float | None = None) -> Replica:
        """Stop one replica's process group and start it again with the same settings (a new
        process: vLLM's KV-event sequence restarts at 0), then wait for its /health."""
        if self._stopped or not self.replicas:
            raise FleetError("the fleet is not running")
        rep = self.replicas[index]
        if rep.child is not None:
            rep.stopping = True
            rep.child.stop(self.spec.stop_grace_s, self._on_kill(rep))
        self._spawn(rep, mode="ab")
        self.wait_healthy(timeout_s)
        return rep

    def check(self) -> None:
        """Raise ReplicaFailedError if a replica process has exited (and was not stopped)."""
        for rep in self.replicas:
            rc = rep.exited()
            if rc is not None and not rep.stopping:
                raise ReplicaFailedError(rep.name, f"exited with code {rc}", rep.log_tail())

    def _retry_failed_starts(self) -> None:
        """Start again, within `startup_retries`, a replica that exited before it was healthy."""
        for rep in self.replicas:
            rc = rep.exited()
            if rc is None or rep.stopping or rep.healthy_at is not None:
                continue
            if rep.startup_failures >= self.spec.startup_retries:
                continue
            rep.startup_failures += 1
            if rep.child is not None:  # what the dead leader left in its group goes first
                rep.child.stop(self.spec.stop_grace_s, self._on_kill(rep))
            self._log(
                f"{rep.name}: exited with code {rc} while starting; starting it again "
                f"({rep.startup_failures}/{self.spec.startup_retries})\n{_error_lines(rep.log_path)}"
            )
            self._spawn(rep, mode="ab")

    def _poll_health(self, client: httpx.Client) -> None:
        for rep in self.replicas:
            if rep.healthy_at is not None:
                continue
            with contextlib.suppress(httpx.HTTPError):
                if client.get(f"{rep.url}/health").status_code == 200:
                    rep.healthy_at = time.monotonic()
                    self._log(f"{rep.name}: healthy after {rep.startup_s:.1f} s at {rep.url}")

    def wait_healthy(self, timeout_s: float | None = None, progress_every_s: float = 10.0) -> None:
        """Block until every replica answers /health with 200; fail fast if one dies."""
        timeout_s = self.spec.startup_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        next_progress = time.monotonic() + progress_every_s
        with httpx.Client(timeout=2.0) as client:
            while True:
                self._retry_failed_starts()
                self.check()
                self._poll_health(client)
                if all(r.healthy_at is not None for r in self.replicas):
                    break
                now = time.monotonic()
                if now > deadline:
                    slow = [r for r in self.replicas if r.healthy_at is None]
                    raise ReplicaFailedError(
                        slow[0].name,
                        f"not healthy after {timeout_s:.0f} s",
                        slow[0].log_tail(),
                    )
                if now >= next_progress:
                    ok = sum(r.healthy_at is not None for r in self.replicas)
                    self._log(
                        f"waiting for /health: {ok}/{len(self.replicas)} healthy "
                        f"after {now - self.started_at:.0f} s"
                    )
                    next_progress = now + progress_every_s
                time.sleep(0.5)
        self.healthy_at = time.monotonic()

    def start(self, timeout_s: float | None = None) -> LocalFleet:
        """Launch and wait for health; stops everything if that fails."""
        self.launch()
        try:
            self.wait_healthy(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """SIGTERM every process group, wait, SIGKILL leftovers. Idempotent, thread-safe."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        with contextlib.suppress(Exception):
            atexit.unregister(self.stop)
        started = [(r, r.child) for r in self.replicas if r.child is not None]
        for rep, child in started:
            rep.stopping = True
            child.terminate()
        deadline = time.monotonic() + self.spec.stop_grace_s
        for rep, child in started:
            child.finish(deadline, self._on_kill(rep))
        if started:
            self._log("fleet stopped")
        if (
            self._owns_log_dir
            and self.log_dir is not None
            and os.environ.get("LOCAL_FLEET_KEEP_LOGS") is None
        ):
            shutil.rmtree(self.log_dir, ignore_errors=True)

    def _on_kill(self, rep: Replica) -> Callable[[], None]:
        return lambda: self._log(f"{rep.name}: still running after SIGTERM, sending SIGKILL")

    # -- async --------------------------------------------------------------------------------

    async def astart(self, timeout_s: float | None = None) -> LocalFleet:
        self.launch()
        timeout_s = self.spec.startup_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        try:
            async with httpx.AsyncClient(timeout=2.0) as client:
                while True:
                    self._retry_failed_starts()
                    self.check()
                    for rep in self.replicas:
                        if rep.healthy_at is None:
                            with contextlib.suppress(httpx.HTTPError):
                                resp = await client.get(f"{rep.url}/health")
                                if resp.status_code == 200:
                                    rep.healthy_at = time.monotonic()
                                    self._log(f"{rep.name}: healthy after {rep.startup_s:.1f} s")
                    if all(r.healthy_at is not None for r in self.replicas):
                        break
                    if time.monotonic() > deadline:
                        slow = next(r for r in self.replicas if r.healthy_at is None)
                        raise ReplicaFailedError(
                            slow.name, f"not healthy after {timeout_s:.0f} s", slow.log_tail()
                        )
                    await asyncio.sleep(0.5)
            self.healthy_at = time.monotonic()
        except BaseException:
            await asyncio.shield(asyncio.to_thread(self.stop))
            raise
        return self

    async def astop(self) -> None:
        await asyncio.to_thread(self.stop)

    # -- context managers ---------------------------------------------------------------------

    def __enter__(self) -> LocalFleet:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    async def __aenter__(self) -> LocalFleet:
        return await self.astart()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.astop()

    # -- views --------------------------------------------------------------------------------

    @property
    def urls(self) -> list[str]:
        return [r.url for r in self.replicas]

    @property
    def startup_s(self) -> float | None:
        return None if self.healthy_at is None else self.healthy_at - self.started_at

    def pgids(self) -> list[int]:
        return [r.child.pgid for r in self.replicas if r.child is not None]

    def describe(self) -> dict[str, object]:
        s = self.spec
        return {
            "engine": s.engine,
            "model_name": s.model_name,
            "block_size": s.block_size,
            "python_hash_seed": s.python_hash_seed,
            "startup_s": None if self.startup_s is None else round(self.startup_s, 1),
            "replicas": [r.describe() for r in self.replicas],
        }


def with_overrides(spec: FleetSpec, **changes: object) -> FleetSpec:
    """`dataclasses.replace` with validation, for callers building specs from flags."""
    new = replace(spec, **changes)  # type: ignore[arg-type]
    new.validate()
    return new


def run_until_signalled(fleet: LocalFleet, *, poll_s: float = 1.0) -> None:
    """Block until SIGINT/SIGTERM/SIGHUP or a replica failure; always stop the fleet.

    Raises ReplicaFailedError if a replica died; returns normally on a signal.
    """

    class _Stop(Exception):
        pass

    def _handler(signum: int, _frame: object) -> None:
        raise _Stop(signal.Signals(signum).name)

    previous = {s: signal.signal(s, _handler) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        while True:
            fleet.check()
            time.sleep(poll_s)
    except (KeyboardInterrupt, _Stop):
        return
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        # a second Ctrl-C while stopping must not leave processes behind
        old_int = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            fleet.stop()
        finally:
            signal.signal(signal.SIGINT, old_int)


__all__ = [
    "ENGINES",
    "ArgvFactory",
    "FleetError",
    "FleetSpec",
    "LocalFleet",
    "Replica",
    "ReplicaFailedError",
    "ReplicaLaunch",
    "layout",
    "run_until_signalled",
    "sim_argv",
    "vllm_argv",
    "with_overrides",
]
