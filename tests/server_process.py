"""Run `kiln serve` as a real subprocess on 127.0.0.1 for the server tests."""

from __future__ import annotations

import re

import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

# Engine start-up is ~15-40 s on a loaded 2-core machine; leave a wide margin.
START_TIMEOUT_S = 300


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log_path.unlink(missing_ok=True)
        return self.proc.returncode


def start_server(*args: str, env: dict[str, str] | None = None) -> ServerProcess:
    """Start `kiln serve` with the default model and `args` (and `env` added to the
    environment); returns once /health is OK."""
    port = free_port()
    log = tempfile.NamedTemporaryFile(prefix="kiln-serve-", suffix=".log", delete=False)
    # KILN_TEST_SERVE_ARGS: extra options for local debugging (e.g. --verbose).
    extra = shlex.split(os.environ.get("KILN_TEST_SERVE_ARGS", ""))
    cmd = [sys.executable, "-m", "kiln.runtime.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           *args, *extra]
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", **(env or {}))
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    server = ServerProcess(proc, port, Path(log.name))
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"kiln serve exited with {proc.returncode} during start-up:\n{server.log_tail()}")
        try:
            if httpx.get(server.url + "/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    server.stop()
    raise RuntimeError(f"kiln serve did not become healthy in {START_TIMEOUT_S}s:\n{server.log_tail()}")


def metric(text: str, name: str, labels: str = "") -> float:
    """The value of one sample in Prometheus text (`labels` like 'endpoint="/v1/x",status="200"')."""
    key = f"{name}{{{labels}}}" if labels else name
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        parts = line.rsplit(" ", 1)
        # Every kiln: metric carries model_name (as vLLM's do); match the other labels.
        sample = re.sub(r'model_name="[^"]*",?', "", parts[0]).replace(",}", "}").replace("{}", "")
        if len(parts) == 2 and sample == key:
            return float(parts[1])
    raise KeyError(f"{key} not in metrics")
