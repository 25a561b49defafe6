"""Launch a real `sluice serve` process on a loopback port for tests."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RemoteServer:
    """`sluice serve ARGS` in a subprocess; use as a context manager."""

    def __init__(self, args: list[str], env: Optional[dict] = None, startup_timeout: float = 240.0):
        self.port = free_port()
        self.host = "127.0.0.1"
        self.args = list(args)
        self.env = {**os.environ, **(env or {})}
        self.startup_timeout = startup_timeout
        self.proc: Optional[subprocess.Popen] = None
        self.log_path = Path(os.environ.get("SLUICE_TEST_LOG_DIR", "/tmp")) / f"sluice-server-{self.port}.log"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def start(self) -> "RemoteServer":
        cmd = [sys.executable, "-m", "sluice.cli", "serve", "--host", self.host, "--port", str(self.port), *self.args]
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=self.env)
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"server did not become healthy:\n{self.log()}")

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-8000:]
        except OSError:
            return ""

    def send_signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def stop(self, timeout: float = 30.0) -> Optional[int]:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode

    def __enter__(self) -> "RemoteServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
