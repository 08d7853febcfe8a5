"""A real ``python -m launch serve`` process for tests: a free port on 127.0.0.1, wait until
/health answers 200, stop it with SIGTERM and return its exit code.

The server's output goes to a file (a pipe nobody reads could fill and block the server); a
failure to come up raises with that output, so a test failure shows why.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from tests.support.pythonpath import checkout_first

__all__ = ["IDS", "ServeProcess", "free_port", "get"]

ROOT = Path(__file__).resolve().parents[2]
# vLLM's extra that puts each choice's output token_ids in the response (a server with a
# tokenizer gives them only when asked): the openai client sends it as ``extra_body=IDS``.
IDS = {"return_token_ids": True}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str, headers: dict[str, str] | None = None, timeout: float = 10.0) -> tuple[int, str]:
    """(status, body) of a GET; an HTTP error status is returned, not raised."""
    try:
        with urllib.request.urlopen(
            urllib.request.Request(url, headers=headers or {}), timeout=timeout
        ) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


class ServeProcess:
    """``with ServeProcess(tmp_path, "--model", d, "--launcher", "local") as srv:`` gives
    ``srv.url`` (``http://127.0.0.1:PORT``) once /health is 200; leaving sends SIGTERM and
    stores ``srv.returncode``."""

    def __init__(
        self,
        log_dir: Path,
        *args: str,
        env: dict[str, str] | None = None,
        start_timeout_s: float = 240,
    ):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log_dir) / f"serve-{self.port}.log"
        self.args = [sys.executable, "-m", "launch", "serve", "--port", str(self.port), *args]
        self.env = {**os.environ, "PYTHONPATH": checkout_first(ROOT), **(env or {})}
        self.start_timeout_s = start_timeout_s
        self.returncode: int | None = None
        self.proc: subprocess.Popen | None = None

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""

    def __enter__(self) -> ServeProcess:
        with open(self.log_path, "w") as out:
            self.proc = subprocess.Popen(
                self.args, stdout=out, stderr=subprocess.STDOUT, env=self.env, cwd=ROOT
            )
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"serve exited with {self.proc.returncode} before it was up:\n{self.log()}"
                )
            try:
                if get(self.url + "/health", timeout=2)[0] == 200:
                    return self
            except OSError:
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"serve was not up after {self.start_timeout_s} s:\n{self.log()}")

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 60) -> int:
        if self.proc is not None and self.returncode is None:
            self.proc.send_signal(sig)
            try:
                self.returncode = self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.returncode = self.proc.wait()
        return self.returncode

    def __exit__(self, *exc) -> None:
        self.stop()

    def metrics(self, api_key: str | None = None) -> dict:
        """/metrics parsed with prometheus_client's parser: {(name, labels tuple): value}."""
        from prometheus_client.parser import text_string_to_metric_families

        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        status, text = get(self.url + "/metrics", headers)
        if status != 200:
            raise RuntimeError(f"/metrics answered {status}: {text}")
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text)
            for s in fam.samples
        }

    def wait_kv_free(self, api_key: str | None = None, rank: int = 0) -> dict:
        """/metrics once ``rank``'s KV slots are all free again (a step or two after an
        abort); raises after 20 s of polling."""
        key = (("rank", str(rank)),)
        for _ in range(400):
            m = self.metrics(api_key)
            if m[("dp_runtime_kv_cache_free_slots", key)] == m[("dp_runtime_kv_cache_slots", key)]:
                return m
            time.sleep(0.05)
        raise AssertionError(f"KV of rank {rank} not freed: {m}")

    def hold_streams(self, path: str, body: dict, n: int, api_key: str | None = None) -> list:
        """``n`` streaming POSTs of ``body`` on raw sockets, returned once the engine holds all
        of them (rank 0's in-flight count). A queued stream gets no headers until its first
        token, so a client call would block; closing a socket is a client leaving."""
        data = json.dumps(body).encode()
        auth = f"Authorization: Bearer {api_key}\r\n" if api_key else ""
        head = (f"POST {path} HTTP/1.1\r\nHost: x\r\n{auth}Content-Type: application/json\r\n"
                f"Content-Length: {len(data)}\r\n\r\n").encode()
        socks = [socket.create_connection(("127.0.0.1", self.port)) for _ in range(n)]
        for s in socks:
            s.sendall(head + data)
        for _ in range(400):
            m = self.metrics(api_key)
            if m[("dp_runtime_in_flight_requests", (("rank", "0"),))] == n:
                return socks
            time.sleep(0.02)
        raise AssertionError(f"{n} requests never in flight together: {m}")
