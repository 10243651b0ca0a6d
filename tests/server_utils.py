"""A real `kvserve serve` subprocess on a free loopback port, for the HTTP and CLI tests."""
from __future__ import annotations

import json
import os
import random
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


_PORTS_PER_PROCESS = 1000
_handed_out: set[int] = set()


def free_port() -> int:
    """A free loopback port for a server started a moment later. It comes from a range of this pytest process's own
    (pytest-xdist's gw0, gw1, ...: make test runs two) below the kernel's ephemeral ports, where outgoing
    connections take theirs: between the check here and the server's bind, neither the other test process nor a
    connection can take it, and no other process's server can answer the test."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    first = 20000 + _PORTS_PER_PROCESS * (int(worker) % 12 if worker.isdigit() else 0)
    for port in random.sample(range(first, first + _PORTS_PER_PROCESS), _PORTS_PER_PROCESS):
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free port in {first}..{first + _PORTS_PER_PROCESS - 1}")


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

    def wait_output(self, text: str, timeout_s: float = 10.0) -> bool:
        """Whether `text` shows in the server's output within timeout_s: an access log line is written after its
        response has gone out, so a client can read the log before it is there."""
        deadline = time.monotonic() + timeout_s
        while text not in self.output():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

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
