"""Logprobs of sampled tokens on a rank (``SamplingParams.logprobs``), tiny preset on CPU: each
reported logprob is the float32 log-softmax of the step's logits row (the row the worker keeps
with ``keep_logits``) at the sampled token, before temperature and top-p; the top N are that
row's N largest, in order; and asking for logprobs never changes a token (greedy, whose rows
then leave the device-side argmax path, and seeded sampling).

``logit_bias`` on the same rank: +100 makes greedy and sampled requests produce only that
token, -100 on the greedy token gives the next most likely one of the kept (raw) row, the
logprobs stay the raw ones, and the requests without a bias in the same steps produce what they
produce without biased neighbours."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dp_runtime.rank_spec import RankSpec
from dp_runtime.rank_worker import RankWorker
from dp_runtime.serving.request import LOGPROBS_LIMIT, Request, SamplingParams

# (temperature, top_p, logprobs asked) per request; the None rows share steps with the others.
_ROWS = ((0.0, 1.0, 3), (0.9, 0.8, 0), (0.0, 1.0, None), (1.3, 1.0, LOGPROBS_LIMIT), (0.7, 1.0, None))
_LENS = (9, 30, 17, 4, 22)


def _requests(logprobs: bool) -> list[Request]:
    g = torch.Generator().manual_seed(3)
    out = []
    for i, ((t, p, n), length) in enumerate(zip(_ROWS, _LENS, strict=True)):
        sp = SamplingParams(max_new_tokens=7, temperature=t, top_p=p, seed=100 + i,
                            logprobs=n if logprobs else None)
        out.append(Request(f"r{i}", torch.randint(0, 256, (length,), generator=g).tolist(), sp))
    return out


def _serve(logprobs: bool, keep_logits: bool, device: str = "cpu"):
    spec = RankSpec.create("tiny", dp_size=1, device=device, dtype="float32" if device == "cpu" else "bfloat16",
                           max_running_requests=4, chunked_prefill_size=32, max_context_len=96, attention="sdpa")
    with RankWorker(spec, keep_logits=keep_logits) as w:
        return {r.rid: r for r in w.generate(_requests(logprobs))}, w.sampled_logits


def _runs(device: str = "cpu"):
    plain, _ = _serve(logprobs=False, keep_logits=False, device=device)  # greedy rows on the device path
    kept, logits = _serve(logprobs=True, keep_logits=True, device=device)
    asked, _ = _serve(logprobs=True, keep_logits=False, device=device)  # the rows that asked alone go to the host
    return plain, kept, logits, asked


@pytest.fixture(scope="module")
def runs():
    return _runs()


FORCED = 77  # a token the +100 bias forces (the tiny preset has no EOS to stop on it)


def _biased_run(kept: dict, device: str = "cpu"):
    """``_requests(logprobs=True)`` with r0 (greedy) and r1 (sampled, top-p) forced to FORCED
    and r2 (greedy) banned its first token of ``kept``; r3 and r4 as they are. Returns the
    results and the kept logits rows."""
    bias = {"r0": ((FORCED, 100.0),), "r1": ((FORCED, 100.0),), "r2": ((kept["r2"].output_ids[0], -100.0),)}
    reqs = [dataclasses.replace(r, sampling=dataclasses.replace(r.sampling, logit_bias=bias.get(r.rid, ())))
            for r in _requests(logprobs=True)]
    spec = RankSpec.create("tiny", dp_size=1, device=device, dtype="float32" if device == "cpu" else "bfloat16",
                           max_running_requests=4, chunked_prefill_size=32, max_context_len=96, attention="sdpa")
    with RankWorker(spec, keep_logits=True) as w:
        return {r.rid: r for r in w.generate(reqs)}, w.sampled_logits


def _check_bias(kept: dict, biased: dict, logits: dict, abs_tol: float = 1e-6) -> None:
    assert biased["r0"].output_ids == biased["r1"].output_ids == (FORCED,) * 7
    banned = kept["r2"].output_ids[0]
    for i, (tok, row) in enumerate(zip(biased["r2"].output_ids, logits["r2"], strict=True)):
        assert tok != banned
        # the largest of the rest (by value: bf16 logits on a GPU tie)
        assert row[tok] == row.clone().index_fill_(0, torch.tensor([banned]), -torch.inf).max()
        if i == 0:  # the kept rows are raw: the banned token was the greedy one
            assert row[banned] == row.max()
    for rid, n in (("r0", 3), ("r1", 0)):  # the raw log-softmax at the forced token, not ~0
        lps = biased[rid].logprobs
        for tok, (lp, top), row in zip(biased[rid].output_ids, lps, logits[rid], strict=True):
            want = torch.log_softmax(row.float(), dim=-1)
            assert lp == pytest.approx(want[tok].item(), abs=abs_tol) and lp < -1
            assert [v for _, v in top] == pytest.approx(want.topk(n).values.tolist(), abs=abs_tol)
    for rid in ("r3", "r4"):  # no bias: what they produce beside unbiased neighbours
        assert (biased[rid].output_ids, biased[rid].logprobs) == (kept[rid].output_ids, kept[rid].logprobs)


def test_a_logit_bias_forces_and_bans_tokens_and_the_logprobs_stay_raw(runs):
    _, kept, _, _ = runs
    _check_bias(kept, *_biased_run(kept))


@pytest.mark.gpu
def test_on_a_gpu_with_graphs_the_same_holds():
    # bf16 on CUDA with decode graphs: the log-softmax runs on the device (kept rows are its
    # float32 input, copied), the greedy rows' device argmax and the host path agree.
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    gpu = _runs("cuda")
    test_logprobs_never_change_the_tokens(gpu)
    test_logprobs_are_the_log_softmax_of_the_sampled_row(gpu, abs_tol=1e-5)
    _check_bias(gpu[1], *_biased_run(gpu[1], "cuda"), abs_tol=1e-5)  # a copy of the biased rows


def test_logprobs_never_change_the_tokens(runs):
    plain, kept, _, asked = runs
    for rid, res in plain.items():
        assert res.output_ids == kept[rid].output_ids == asked[rid].output_ids, rid
        assert res.logprobs is None and len(res.output_ids) == 7
    assert {rid: r.logprobs for rid, r in kept.items()} == {rid: r.logprobs for rid, r in asked.items()}


def test_logprobs_are_the_log_softmax_of_the_sampled_row(runs, abs_tol=1e-6):
    _, kept, logits, _ = runs
    for (_, _, n), (rid, res) in zip(_ROWS, kept.items(), strict=True):
        if n is None:
            assert res.logprobs is None
            continue
        assert len(res.logprobs) == len(res.output_ids) == len(logits[rid])
        for tok, (lp, top), row in zip(res.output_ids, res.logprobs, logits[rid], strict=True):
            want = torch.log_softmax(row.float(), dim=-1)
            assert isinstance(lp, float) and lp <= 0
            assert lp == pytest.approx(want[tok].item(), abs=abs_tol)
            assert len(top) == n
            if n:
                vals, _ = want.topk(n)
                # the N largest values in order, each at its id (ties, as bf16 logits make on a
                # GPU, may list equal values' ids in either order)
                assert [v for _, v in top] == pytest.approx(vals.tolist(), abs=abs_tol)
                assert [v for _, v in top] == pytest.approx([want[i].item() for i, _ in top], abs=abs_tol)
                assert len({i for i, _ in top}) == n
                assert all(isinstance(i, int) for i, _ in top)
                if res.rid == "r0":  # greedy: the sampled token is (tied with) the first of the top
                    assert top[0][1] == pytest.approx(lp, abs=abs_tol) and (tok, top[0][1]) in top


@pytest.mark.parametrize("bad", [-1, LOGPROBS_LIMIT + 1, True, 2.0, "3"])
def test_a_bad_logprobs_names_the_field_the_limit_and_the_value(bad):
    with pytest.raises(ValueError, match=rf"SamplingParams.logprobs .*\[0, {LOGPROBS_LIMIT}\], got {bad!r}"):
        SamplingParams(logprobs=bad)
