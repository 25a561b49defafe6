"""Launch a real `sluice serve` process on a loopback port for tests."""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import httpx
import pytest


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


def scrape_metrics(server: RemoteServer) -> dict[str, float]:
    """`name{labels}` -> value, for every sample in /metrics."""
    text = httpx.get(server.url + "/metrics", timeout=10).text
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def metric(samples: dict[str, float], name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    total = 0.0
    for key, value in samples.items():
        base, _, label_str = key.partition("{")
        found = dict(re.findall(r'(\w+)="([^"]*)"', label_str))
        if base == name and all(found.get(k) == v for k, v in labels.items()):
            total += value
    return total


def wait_until_idle(server: RemoteServer, timeout: float = 20.0) -> dict[str, float]:
    """Poll until no request is running or waiting and no KV block is in use."""
    deadline = time.monotonic() + timeout
    while True:
        load = httpx.get(server.url + "/load", timeout=10).json()
        samples = scrape_metrics(server)
        if load["running"] == 0 and load["waiting"] == 0 and metric(samples, "sluice:kv_cache_blocks_used") == 0:
            return samples
        if time.monotonic() > deadline:
            pytest.fail(f"server still busy after {timeout}s: {load}")
        time.sleep(0.2)
