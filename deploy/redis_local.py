"""A private, throwaway `redis-server` for `make run`, tests and benchmarks.

Never touches 127.0.0.1:6379: it picks a free loopback port, runs with no persistence
(`--save "" --appendonly no`) in its own temporary directory, waits until it answers PING, and
always kills the process on teardown. `tls=True` serves TLS only (a self-signed certificate
made with `openssl`; `ca_file` verifies it). `kill()` (SIGKILL), `pause()`/`resume()`
(SIGSTOP/SIGCONT, a hung server) and `restart()` (same port, empty data) simulate failures.
The server runs in its own process group (`deploy.processes`); every signal goes to the group.

    with RedisServer() as server:
        client = redis.asyncio.Redis.from_url(server.url)
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

from deploy.processes import Child, spawn

REDIS_SERVER = os.environ.get("CP_REDIS_SERVER", "redis-server")
STOP_GRACE_S = 5.0


def free_port() -> int:
    """A loopback TCP port nobody listens on right now (never 6379)."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        if port != 6379:
            return port


def available() -> bool:
    return shutil.which(REDIS_SERVER) is not None


class RedisServer:
    """One redis-server process on 127.0.0.1:`port` (chosen once, kept across restarts)."""

    def __init__(
        self, *, password: str | None = None, tls: bool = False, extra_args: tuple[str, ...] = ()
    ) -> None:
        self.password = password
        self.tls = tls
        self.extra_args = extra_args
        self.port = 0
        self.child: Child | None = None
        self.paused = False
        self._tmp: tempfile.TemporaryDirectory[str] | None = None

    # -- lifecycle -------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        scheme = "rediss" if self.tls else "redis"
        return f"{scheme}://{auth}127.0.0.1:{self.port}/0"

    @property
    def ca_file(self) -> str:
        return str(self.dir / "cert.pem")

    def _make_cert(self) -> None:
        if (self.dir / "cert.pem").exists():
            return
        subprocess.run(
            ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
             "-keyout", str(self.dir / "key.pem"), "-out", str(self.dir / "cert.pem"),
             "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
            check=True, capture_output=True,
        )  # fmt: skip

    @property
    def pid(self) -> int | None:
        return self.child.pid if self.child is not None else None

    @property
    def running(self) -> bool:
        return self.child is not None and self.child.poll() is None

    @property
    def dir(self) -> Path:
        if self._tmp is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="cp-redis-")
        return Path(self._tmp.name)

    def start(self, timeout_s: float = 10.0) -> None:
        """Start (a restart keeps its port) and wait until PING answers."""
        if self.running:
            raise RuntimeError("redis-server already running")
        keep_port = bool(self.port)
        last_error = ""
        for _attempt in range(5):
            if not self.port:
                self.port = free_port()
            self._spawn()
            try:
                self._wait_ready(timeout_s)
                return
            except RuntimeError as exc:  # most likely the port was taken in between: retry
                last_error = str(exc)
                self.kill()
                if not keep_port:
                    self.port = 0
        raise RuntimeError(f"redis-server did not start: {last_error}")

    def _spawn(self) -> None:
        listen = ["--port", str(self.port)]
        if self.tls:
            self._make_cert()
            listen = [
                "--port", "0", "--tls-port", str(self.port),
                "--tls-cert-file", self.ca_file, "--tls-key-file", str(self.dir / "key.pem"),
                "--tls-ca-cert-file", self.ca_file, "--tls-auth-clients", "no",
            ]  # fmt: skip
        args = [
            REDIS_SERVER,
            *listen,
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--dir", str(self.dir),
            "--logfile", str(self.dir / "redis.log"),
            "--daemonize", "no",
            "--databases", "1",
        ]  # fmt: skip
        if self.password:
            args += ["--requirepass", self.password]
        args += list(self.extra_args)
        # die_with_parent: a parent killed outright (SIGKILL) still takes its private server along
        self.child = spawn(
            args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, die_with_parent=True
        )

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.child is None or self.child.poll() is not None:
                raise RuntimeError(f"exited early: {self.log_tail()}")
            if self.ping():
                return
            time.sleep(0.01)
        raise RuntimeError(f"not ready after {timeout_s}s: {self.log_tail()}")

    def ping(self, timeout_s: float = 0.2) -> bool:
        """PING over a raw socket (no client library), AUTH first if needed."""
        try:
            with contextlib.ExitStack() as stack:
                sock = stack.enter_context(
                    socket.create_connection(("127.0.0.1", self.port), timeout=timeout_s)
                )
                if self.tls:
                    ctx = ssl.create_default_context(cafile=self.ca_file)
                    sock = stack.enter_context(ctx.wrap_socket(sock, server_hostname="127.0.0.1"))
                payload = b""
                if self.password:
                    pw = self.password.encode()
                    payload += b"*2\r\n$4\r\nAUTH\r\n$%d\r\n%s\r\n" % (len(pw), pw)
                payload += b"*1\r\n$4\r\nPING\r\n"
                sock.sendall(payload)
                data = b""
                while b"PONG" not in data and b"-" not in data:
                    chunk = sock.recv(256)
                    if not chunk:
                        break
                    data += chunk
                return b"+PONG" in data
        except (OSError, ssl.SSLError):
            return False

    def log_tail(self, lines: int = 20) -> str:
        log = self.dir / "redis.log"
        if not log.exists():
            return "(no log)"
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])

    def _release(self) -> Child | None:
        child, self.child = self.child, None
        self.paused = False
        return child

    def stop(self) -> None:
        """SIGTERM (a paused server is resumed first), then SIGKILL if it does not exit."""
        if (child := self._release()) is not None:
            child.stop(STOP_GRACE_S)

    def kill(self) -> None:
        """SIGKILL: the server dies with no goodbye (clients see resets/refusals)."""
        if (child := self._release()) is not None:
            child.kill()

    def pause(self) -> None:
        """SIGSTOP: the server keeps its socket but answers nothing (a hung Redis)."""
        if self.child is not None:
            self.child.signal(signal.SIGSTOP)
            self.paused = True

    def resume(self) -> None:
        if self.child is not None:
            self.child.signal(signal.SIGCONT)
            self.paused = False

    def restart(self, timeout_s: float = 10.0) -> None:
        """Kill and start again on the same port, with empty data."""
        self.kill()
        self.start(timeout_s)

    def close(self) -> None:
        """Kill the process (always) and remove the temporary directory."""
        try:
            self.kill()
        finally:
            if self._tmp is not None:
                self._tmp.cleanup()
                self._tmp = None

    def __enter__(self) -> RedisServer:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
