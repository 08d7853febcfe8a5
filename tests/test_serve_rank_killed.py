"""A rank killed under load on `dp-runtime serve --dp 2` (a Ray gang on a private cluster; issue
45 "Tests", the 2-GPU one): while streams and a whole request are in flight on both ranks, one
rank actor's process is killed (SIGKILL). Then:

- ``/health`` answers 503 ``restarting`` from the moment the engine notices until the new gang
  serves, then 200;
- every request in flight ends with a named error: a stream with an error event
  (``engine_unavailable``, naming the lost rank), then ``data: [DONE]`` (never a hang, never a
  stream cut without an error event); the whole request with a 503 JSON body and Retry-After;
- a new request sent while the gang restarts gets a 503 with Retry-After and OpenAI's error
  object (one sent just as the new gang came up may be served);
- after the restart the same greedy prompt gives the same tokens as before the kill;
- on CPU (with psutil) the private cluster and both gangs listen on loopback only (GCS,
  raylet, agents, workers, the ranks' process-group store and gloo).

The same body runs on CPU (gloo, in the unit run) and on 2 GPUs (``-m gpu``: NCCL, one GPU a
rank; ``bash bench/run_gpu.sh door2``). HTTP through the standard library only: the GPU
machine has no ``openai`` (nor ``httpx`` here), and Ray and the server's packages come from its
bundle, so they are checked in the test, not at import. Processes are told apart by a marker in
their environment, which every process the server starts inherits (Ray's workers included).
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest

from tests.support.serve_process import ServeProcess, get

MARKER = "DP_RUNTIME_TEST_MARKER"
STREAMS = 4  # with the whole request, more than one a rank: the router puts some on each
LONG = 1900  # tokens a request in flight asks for: it is still generating when its rank dies
GREEDY = {"model": "tiny", "prompt": [5, 17, 42, 7], "max_tokens": 12, "temperature": 0.0,
          "ignore_eos": True, "return_token_ids": True}


def _post(url: str, body: dict, timeout: float = 120.0) -> tuple[int, dict, str]:
    """(status, headers (lower-case names), body) of a JSON POST; an HTTP error status is
    returned, not raised."""
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, {k.lower(): v for k, v in r.headers.items()}, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, {k.lower(): v for k, v in e.headers.items()}, e.read().decode()


def _stream(url: str, body: dict, events: list[str]) -> None:
    """A streaming POST: each ``data:`` payload appended to ``events`` as it comes; a connection
    cut or a status other than 200 is appended as ``!`` and what happened."""
    req = urllib.request.Request(url, json.dumps({**body, "stream": True}).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            for line in r:  # http.client reads the chunked body a line at a time
                if line.startswith(b"data: "):
                    events.append(line[len(b"data: "):].strip().decode())
    except urllib.error.HTTPError as e:
        events.append(f"! HTTP {e.code}: {e.read().decode()}")
    except Exception as e:  # a cut stream (IncompleteRead), a timeout: the test names it
        events.append(f"! {type(e).__name__}: {e}")


def _rank_actors(tag: str) -> list[int]:
    """Pids of the rank actors of the server that carries MARKER=tag."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            env = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue  # gone, or not ours to read
        if f"{MARKER}={tag}".encode() in env and b"RankActor" in cmd:
            found.append(int(entry))
    return found


def _greedy(url: str) -> list[int]:
    status, _, text = _post(url + "/v1/completions", GREEDY)
    assert status == 200, text
    choice = json.loads(text)["choices"][0]
    assert choice["finish_reason"] == "length", choice
    return choice["token_ids"]


def _loopback_sockets(srv: ServeProcess, device: str):
    """The server tree's listening sockets, checked to be on loopback with the ranks among
    them; on CPU with psutil (the GPU machine has no psutil), else None."""
    if device != "cpu":
        return None
    pytest.importorskip("psutil")
    import psutil

    from tests.support.listening import assert_loopback_only, ranks_listen, tree_sockets

    sockets = tree_sockets(psutil.Process(srv.proc.pid))
    assert ranks_listen(sockets), sockets
    assert_loopback_only(sockets)
    return sockets


def _in_flight(srv: ServeProcess) -> list[float]:
    m = srv.metrics()
    return [m.get(("dp_runtime_in_flight_requests", (("rank", str(r)),)), 0.0) for r in (0, 1)]


@pytest.mark.skipif(bool(os.environ.get("RAY_ADDRESS")),
                    reason="inside a Ray job the job's cluster is joined: this test starts its own")
# On 2 GPUs each gang captures its graphs: more than the unit run's 300 s may be needed.
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu,
                                                                        pytest.mark.timeout(600)])])
def test_a_rank_killed_under_load_restarts_the_gang_and_every_request_is_answered(tmp_path,
                                                                                  device):
    for module in ("ray", "fastapi", "uvicorn", "prometheus_client"):
        pytest.importorskip(module, reason=f"serve --dp 2 on Ray needs {module}")
    if device == "cuda":
        import torch

        if torch.cuda.device_count() < 2:
            pytest.skip(f"needs 2 CUDA GPUs (one a rank), found {torch.cuda.device_count()}")
    tag = uuid.uuid4().hex
    env = {MARKER: tag, "OMP_NUM_THREADS": "1"}
    with ServeProcess(tmp_path, "--model", "tiny", "--dp", "2", "--device", device,
                      "--max-running-requests", "8", env=env) as srv:
        before = _greedy(srv.url)
        sockets = _loopback_sockets(srv, device)
        assert len(before) == GREEDY["max_tokens"]
        long = {"model": "tiny", "prompt": [3, 1, 4, 1, 5], "max_tokens": LONG,
                "ignore_eos": True}
        whole: list = []
        threads = [threading.Thread(target=lambda: whole.append(
            _post(srv.url + "/v1/completions", long)), daemon=True)]
        streams: list[list[str]] = [[] for _ in range(STREAMS)]
        threads += [threading.Thread(target=_stream, args=(srv.url + "/v1/completions",
                                                           {**long, "prompt": [9, i]}, events),
                                     daemon=True) for i, events in enumerate(streams)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 120
        while (sum(_in_flight(srv)) < STREAMS + 1 or not all(streams)) \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        loads = _in_flight(srv)
        assert sum(loads) == STREAMS + 1 and all(streams), (loads, streams, srv.log()[-3000:])
        assert all(loads), f"every rank holds requests when one dies: {loads}"
        actors = _rank_actors(tag)
        assert len(actors) == 2, (actors, srv.log()[-3000:])
        assert not any("[DONE]" in e for s in streams for e in s), "a stream ended before the kill"
        os.kill(actors[1], signal.SIGKILL)

        health: list[tuple[int, str]] = []  # what a load balancer sees from the kill on
        refused = []  # new requests sent while /health was not 200
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            code, body = get(srv.url + "/health")
            health.append((code, json.loads(body)["status"]))
            if code != 200:
                refused.append(_post(srv.url + "/v1/completions", {**GREEDY, "max_tokens": 2}))
            elif len(set(health)) > 1:  # 200 again after the restart
                break
            time.sleep(0.05)
        for t in threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in threads), "a request in flight hangs"
        after = _greedy(srv.url)
        new_actors = _rank_actors(tag)
        assert len(new_actors) == 2 and not set(new_actors) & set(actors), (actors, new_actors)
        sockets_after = _loopback_sockets(srv, device)
        assert sockets is None or sockets_after != sockets  # the new gang's own sockets

    assert srv.returncode == 0, srv.log()[-3000:]
    # /health: 200 until the engine noticed, then 503 "restarting" until the new gang serves.
    codes = [c for c, _ in health]
    assert codes[-1] == 200 and 503 in codes, (health, srv.log()[-3000:])
    first = codes.index(503)
    assert set(codes[:first]) == {200}, health
    assert set(health[first:-1]) == {(503, "restarting")}, health
    # New requests while restarting: 503, Retry-After, OpenAI's error object (the last one may
    # have been served, if the new gang came up between its /health and its POST).
    assert refused, health
    served = [r for r in refused if r[0] == 200]
    assert not served or (len(served) == 1 and refused[-1][0] == 200), refused
    for status, headers, text in refused[: len(refused) - len(served)]:
        assert status == 503 and int(headers["retry-after"]) >= 1, (status, headers, text)
        assert headers["content-type"].startswith("application/json"), headers
        assert json.loads(text)["error"]["code"] == "engine_unavailable", text
    # In flight at the kill: each named, none cut.
    for events in streams:
        assert len(events) >= 3 and events[-1] == "[DONE]", events[-3:]
        error = json.loads(events[-2])["error"]
        assert error["code"] == "engine_unavailable", error
        assert re.search(r"lost the request's rank \(.*rank \d failed", error["message"]), error
        assert all(not e.startswith("!") for e in events), events
    (status, headers, text), = whole
    assert status == 503 and int(headers["retry-after"]) >= 1, (status, headers, text)
    error = json.loads(text)["error"]
    assert error["code"] == "engine_unavailable", error
    assert re.search(r"lost the request's rank \(.*rank \d failed", error["message"]), error
    # The new gang computes what the old one did.
    assert after == before
