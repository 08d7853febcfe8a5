"""`dp-runtime serve` on a 2-rank Ray gang (a private local cluster on loopback): 8 concurrent
requests through the openai client equal transformers' greedy output and are routed to both
ranks; SIGTERM lets an in-flight stream finish and the server exits 0."""

from __future__ import annotations

import signal
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from tests.hf_reference import greedy_reference, load_reference
from tests.support.serve_model import write_serve_checkpoint
from tests.support.serve_process import ServeProcess


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = write_serve_checkpoint(tmp_path_factory.mktemp("ckpt"))
    return path, load_reference(path)


def test_eight_concurrent_requests_on_two_ranks_equal_transformers_then_sigterm_drains(
    ckpt, tmp_path
):
    path, model = ckpt
    prompts = [[(7 * i + j * 13) % 380 + 3 for j in range(4 + i)] for i in range(8)]
    refs = [greedy_reference(model, p, 8)[0] for p in prompts]
    srv = ServeProcess(
        tmp_path, "--model", str(path), "--launcher", "ray", "--dp", "2", "--max-queued", "16"
    )
    with srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)

        def one(p):
            r = client.completions.create(model=path.name, prompt=p, max_tokens=8, temperature=0)
            return r.choices[0].model_extra["token_ids"]

        with ThreadPoolExecutor(8) as pool:
            outs = list(pool.map(one, prompts))
        assert outs == refs
        m = srv.metrics()
        routed = [m[("dp_runtime_requests_routed_total", (("rank", str(r)),))] for r in (0, 1)]
        assert sum(routed) == 8 and min(routed) >= 1, routed  # the least-loaded rule used both

        stream = client.completions.create(
            model=path.name,
            prompt=prompts[0],
            max_tokens=40,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        chunks = iter(stream)
        first = next(chunks)
        srv.proc.send_signal(signal.SIGTERM)  # drain: the stream still ends by length
        rest = list(chunks)
        reasons = [c.choices[0].finish_reason for c in [first, *rest] if c.choices]
        assert reasons[-1] == "length"
        assert srv.stop() == 0, srv.log()
    assert "stopped" in srv.log()
