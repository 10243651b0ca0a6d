"""A real `kvserve serve` subprocess on a free loopback port, for the HTTP and CLI tests."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx

# the session server of tests/test_server.py and tests/test_server_errors.py (the fixture is in conftest.py)
API_KEY = "test-key"
MODEL = "SmolLM2-135M-Instruct"
MAX_MODEL_LEN = 512
SERVER_FLAGS = ["--dtype", "float32", "--kv-cache-memory", "48MiB", "--max-num-seqs", "32",
                "--max-model-len", str(MAX_MODEL_LEN), "--max-waiting-requests", "200", "--api-key", API_KEY]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A `python -m kvserve serve` (or another serving subcommand: proxy) subprocess on a free loopback port."""

    def __init__(self, *flags: str, command: str = "serve"):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="kvserve-server-", suffix=".log", delete=False)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen([sys.executable, "-m", "kvserve", command, "--port", str(self.port), *flags],
                                     stdout=self.log, stderr=subprocess.STDOUT, env=env)

    def wait_ready(self, timeout_s: float = 180.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"server not healthy after {timeout_s}s:\n{self.output()}")

    def output(self) -> str:
        with open(self.log.name) as f:
            return f.read()

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def metric(server, name: str, **labels) -> float:
    """The value of one sample on /metrics (labels: a subset that must match)."""
    text = httpx.get(f"{server.url}/metrics").text
    for line in text.splitlines():
        m = re.match(r"^([\w:]+)\{(.*)\} (\S+)$", line)
        if m and m.group(1) == name and all(f'{k}="{v}"' in m.group(2) for k, v in labels.items()):
            return float(m.group(3))
    raise KeyError(f"{name} {labels} not on /metrics")


def wait_idle(server, timeout_s: float = 10.0) -> None:
    """Until nothing runs or waits and every KV block is free again."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        names = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
        if all(metric(server, n) == 0 for n in names):
            return
        time.sleep(0.1)
    raise AssertionError(httpx.get(f"{server.url}/metrics").text)


def post(server, path: str, body, key: str | None = API_KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    content = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return httpx.post(f"{server.url}{path}", content=content, headers=headers, timeout=60)
