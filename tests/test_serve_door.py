"""`dp-runtime serve`'s door under abuse, and its lifecycle, on real server processes (a tiny
preset, the local launcher, CPU):

- a body over ``--max-request-bytes`` is a 413 with OpenAI's error object (Content-Length or
  chunked), and the server goes on serving;
- connections that send nothing, half the headers or half the body are closed after
  ``--header-timeout`` / ``--body-timeout``, and a normal request still succeeds;
- a string, bool or float for an int field, a non-bool for a bool field: 400 naming it;
- 404, 405 and a body that is not JSON: OpenAI's error object, never ``{"detail": ...}``;
- a temperature inside the documented range but tiny (1e-45) samples as greedy, not a 500;
- a drain past ``--drain-timeout`` ends a stream with an error event and ``[DONE]`` and a
  whole request with a 503 JSON body, no traceback, exit 0;
- while the engine starts (a Ray address that never answers keeps it starting): ``/health``
  503 ``starting``, every other route 503 with Retry-After; SIGTERM then exits 0; SIGTERM as
  soon as a local server answers exits 0 too.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import requests

from tests.support.serve_process import ROOT, ServeProcess, free_port, get

LIMIT = 65536


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with ServeProcess(
        tmp_path_factory.mktemp("logs"), "--model", "tiny", "--launcher", "local",
        "--max-request-bytes", str(LIMIT), "--header-timeout", "1", "--body-timeout", "1",
        "--drain-timeout", "1",
    ) as srv:
        yield srv


def _post(server, body, **kw):
    return requests.post(server.url + "/v1/completions", data=body,
                         headers={"Content-Type": "application/json"}, timeout=60, **kw)


def _ok(server) -> list[int]:
    r = requests.post(server.url + "/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def _error(r, status: int) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json"
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    return err


def test_a_body_over_the_limit_is_413(server):
    prompt = json.dumps({"model": "tiny", "prompt": "a" * (LIMIT + 10)}).encode()
    err = _error(_post(server, prompt), 413)
    assert err["code"] == "request_too_large" and f"the limit is {LIMIT}" in err["message"]
    chunks = (prompt[i:i + 8192] for i in range(0, len(prompt), 8192))  # no Content-Length
    err = _error(_post(server, chunks), 413)
    assert err["code"] == "request_too_large"
    _ok(server)


def test_stalled_connections_are_closed_and_others_served(server):
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    stalls = [b"", head, head + b"Content-Length: 100\r\n\r\n{\"model\"", b"POST /v1/compl"]
    socks = [socket.create_connection(("127.0.0.1", server.port)) for _ in stalls]
    for s, data in zip(socks, stalls, strict=True):
        s.sendall(data)
    _ok(server)  # served while they stall
    for s in socks:
        s.settimeout(60)
        assert s.recv(4096) == b""  # closed by the server (a timeout here raises)
        s.close()
    _ok(server)
    assert "Traceback" not in server.log()


@pytest.mark.parametrize("field,value", [
    ("max_tokens", "4"), ("max_tokens", True), ("max_tokens", 4.0), ("stream", "yes"),
    ("stream", 1), ("n", 1.0), ("seed", "7"), ("temperature", True), ("ignore_eos", "true"),
])
def test_a_value_of_the_wrong_json_type_is_400_naming_the_field(server, field, value):
    body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 4, field: value}
    err = _error(_post(server, json.dumps(body)), 400)
    assert err["param"] == field and repr(value) in err["message"], err


def test_every_error_is_openai_s_object(server):
    err = _error(requests.get(server.url + "/v1/nowhere", timeout=10), 404)
    assert err["code"] == "not_found" and "/v1/nowhere" in err["message"]
    err = _error(requests.get(server.url + "/v1/completions", timeout=10), 405)
    assert err["code"] == "method_not_allowed"
    err = _error(_post(server, b'{"model": "tiny", "prompt": [1,'), 400)
    assert err["code"] == "invalid_json"
    err = _error(_post(server, b"[1, 2]"), 400)
    assert err["type"] == "invalid_request_error"


def test_a_tiny_temperature_is_greedy_not_a_500(server):
    r = requests.post(server.url + "/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": [1, 2, 3], "max_tokens": 4, "temperature": 1e-45})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == _ok(server)


def test_a_drain_past_its_timeout_ends_every_request_by_name(server):
    # Last: it stops the module's server. 2,000 tokens outlast the 1 s drain.
    long = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 2000, "ignore_eos": True}
    whole: list = []
    t = threading.Thread(target=lambda: whole.append(
        requests.post(server.url + "/v1/completions", json=long, timeout=120)))
    t.start()
    with requests.post(server.url + "/v1/completions", json={**long, "stream": True},
                       stream=True, timeout=120) as r:
        lines = r.iter_lines()
        first = next(lines)
        assert first.startswith(b"data: {")
        _wait_in_flight(server, 2)
        server.proc.send_signal(signal.SIGTERM)
        events = [ln for ln in lines if ln]
    t.join()
    assert events[-1] == b"data: [DONE]"
    error = json.loads(events[-2][len(b"data: "):])["error"]
    assert error["type"] == "service_unavailable" and "aborted" in error["message"], error
    err = _error(whole[0], 503)
    assert err["code"] == "engine_unavailable" and whole[0].headers["retry-after"]
    assert server.stop() == 0
    log = server.log()
    assert "Traceback" not in log and "stopped" in log, log


def _wait_in_flight(server, n: int) -> None:
    for _ in range(400):
        m = server.metrics()
        if m[("dp_runtime_in_flight_requests", (("rank", "0"),))] == n:
            return
        time.sleep(0.02)
    raise AssertionError(f"{n} requests never in flight: {m}")


def test_while_the_engine_starts_health_is_503_starting_and_sigterm_exits_0(tmp_path):
    # A Ray address that accepts connections and never answers: ray.init waits on it for
    # minutes, so the engine is starting for the whole test (no timing involved).
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        port = free_port()
        log = tmp_path / "serve.log"
        with open(log, "w") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "launch", "serve", "--model", "tiny", "--launcher", "ray",
                 "--ray-address", address, "--port", str(port)],
                stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                env={**_env(), "PYTHONPATH": str(ROOT)})
        try:
            url = f"http://127.0.0.1:{port}"
            health = _first_answer(url + "/health", proc)
            assert health == (503, {"status": "starting", "state": "starting", "detail": ""})
            r = requests.post(url + "/v1/completions", json={"model": "tiny", "prompt": [1]},
                              timeout=10)
            err = _error(r, 503)
            assert err["code"] == "engine_unavailable" and "starting" in err["message"]
            assert int(r.headers["retry-after"]) >= 1
            assert _error(requests.get(url + "/v1/models", timeout=10), 503)
            assert get(url + "/health")[0] == 503  # still starting
            proc.send_signal(signal.SIGTERM)
            code = proc.wait(60)
        finally:
            if proc.poll() is None:
                proc.kill()
    text = log.read_text()
    assert code == 0, text
    assert f"connecting to Ray ({address})" in text and "stopped" in text, text
    assert "Traceback" not in text, text


def test_sigterm_as_soon_as_a_local_server_answers_exits_0(tmp_path):
    srv = ServeProcess(tmp_path, "--model", "tiny", "--launcher", "local")
    with open(srv.log_path, "w") as out:
        srv.proc = subprocess.Popen(srv.args, stdout=out, stderr=subprocess.STDOUT, env=srv.env,
                                    cwd=ROOT)
    status, _ = _first_answer(srv.url + "/health", srv.proc)
    assert status in (503, 200)  # 503 while the rank starts (nearly always, on a CPU)
    assert srv.stop() == 0, srv.log()
    assert "stopped" in srv.log() and "Traceback" not in srv.log()


def _first_answer(url: str, proc: subprocess.Popen) -> tuple[int, dict]:
    """The first answer of ``url`` once the port listens (it never hangs: a timeout raises)."""
    for _ in range(2400):
        assert proc.poll() is None, "serve exited"
        try:
            r = requests.get(url, timeout=10)
            return r.status_code, r.json()
        except requests.ConnectionError:
            time.sleep(0.05)
    raise AssertionError("the port never listened")


def _env() -> dict[str, str]:
    import os

    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    return env
