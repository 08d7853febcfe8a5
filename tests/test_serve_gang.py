"""`dp-runtime serve` on a 2-rank Ray gang (a private local cluster on loopback): 8 concurrent
requests through the openai client equal transformers' greedy output and are routed to both
ranks; the checkpoint's generation_config.json sampling defaults (``--sampling-defaults model``,
the default: its repetition_penalty on every request here) fill the fields a request leaves
unset and never one it sets; SIGTERM lets an
in-flight stream finish and the server exits 0."""

from __future__ import annotations

import signal
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from tests.hf_reference import greedy_reference, load_reference
from tests.support.serve_model import write_serve_checkpoint
from tests.support.serve_process import IDS, ServeProcess

# top_k 1: a request that leaves top_k unset draws the argmax at any temperature and seed, so
# the default shows as transformers' greedy tokens; repetition_penalty: applied to every request
# that leaves it unset (all of them here), so the references are transformers' with it.
GENERATION = {"top_k": 1, "repetition_penalty": 1.3}
PROMPTS = [[(7 * i + j * 13) % 380 + 3 for j in range(4 + i)] for i in range(8)]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = write_serve_checkpoint(tmp_path_factory.mktemp("ckpt"))
    model = load_reference(path)  # before the sampling keys: its generate would apply them
    write_serve_checkpoint(path, generation=GENERATION)  # the same weights (same seed)
    refs = [greedy_reference(model, p, 8, repetition_penalty=1.3)[0] for p in PROMPTS]
    assert refs != [greedy_reference(model, p, 8)[0] for p in PROMPTS]  # the default shows
    return path, model, refs


@pytest.fixture(scope="module")
def server(ckpt, tmp_path_factory):
    srv = ServeProcess(tmp_path_factory.mktemp("logs"), "--model", str(ckpt[0]), "--launcher", "ray",
                       "--dp", "2", "--max-queued", "16")
    with srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def _ids(r) -> list[int]:
    return r.choices[0].model_extra["token_ids"]


def test_eight_concurrent_requests_on_two_ranks_equal_transformers(ckpt, server, client):
    path, _, refs = ckpt

    def one(p):
        return _ids(client.completions.create(model=path.name, prompt=p, max_tokens=8, temperature=0,
                                              extra_body=IDS))

    with ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(one, PROMPTS))
    assert outs == refs
    m = server.metrics()
    routed = [m[("dp_runtime_requests_routed_total", (("rank", str(r)),))] for r in (0, 1)]
    assert sum(routed) == 8 and min(routed) >= 1, routed  # the least-loaded rule used both


def test_unset_sampling_fields_take_the_checkpoint_s_defaults_and_set_ones_win(ckpt, server, client):
    path, _, refs = ckpt
    kw = dict(model=path.name, max_tokens=8, extra_body={"ignore_eos": True, **IDS})
    # No temperature, no seed: OpenAI's temperature 1 with a random seed, and top_k 1 from the file.
    for p, ref in zip(PROMPTS[:3], refs[:3], strict=True):
        assert _ids(client.completions.create(prompt=p, **kw)) == ref
    # top_k set to off (-1): the client's, though the file says 1; seed 1 draws away from greedy.
    drawn = _ids(client.completions.create(prompt=PROMPTS[0], seed=1, **{**kw, "extra_body": {
        "ignore_eos": True, "top_k": -1, **IDS}}))
    assert drawn != refs[0]
    log = server.log()
    assert ("unset sampling fields take the checkpoint's generation_config.json: top_k=1, "
            "repetition_penalty=1.3") in log, log
    assert "does not implement" not in log, log


def test_sigterm_lets_an_in_flight_stream_finish_then_exits_0(ckpt, server, client):
    # Last: it stops the module's server.
    stream = client.completions.create(model=ckpt[0].name, prompt=PROMPTS[0], max_tokens=40, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    chunks = iter(stream)
    first = next(chunks)
    server.proc.send_signal(signal.SIGTERM)  # drain: the stream still ends by length
    rest = list(chunks)
    reasons = [c.choices[0].finish_reason for c in [first, *rest] if c.choices]
    assert reasons[-1] == "length"
    assert server.stop() == 0, server.log()
    assert "stopped" in server.log()
