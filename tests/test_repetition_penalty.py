"""The repetition penalty (``SamplingParams.repetition_penalty``, dp_runtime/serving/
adjusted_rows.py), against transformers' ``RepetitionPenaltyLogitsProcessor`` on the same
prompt + output ids.

The draw on CPU tensors: each adjusted row is exactly what transformers' processor makes of the
raw row (rows with only that penalty; with presence, frequency and a bias after it, the rule of
tests/test_penalties.py follows it), past a chunk; repetition comes before presence. The marks
table: a request's first draw resets its row to its whole prompt, each step marks its drawn
tokens, and a table no row of the step reads is left alone.

A rank (tiny preset, CPU, ``keep_logits``): greedy and sampled requests with the penalty, beside
a presence-penalized one and a plain one in the same steps, produce exactly what the rule gives
on their kept raw rows step by step, with the prompt's tokens penalized (a prompt longer than a
chunk: every chunk's tokens count) and the overlapped steps' token in flight marked; a reused
request row starts from its own prompt alone.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from dp_runtime.rank_spec import RankSpec
from dp_runtime.rank_worker import RankWorker
from dp_runtime.serving.adjusted_rows import adjusted_chunks
from dp_runtime.serving.penalty_counts import PenaltyCounts, StepCounts
from dp_runtime.serving.request import Request, SamplingParams
from dp_runtime.serving.sampling import ROW_CHUNK, draw_tokens
from tests.test_penalties import _penalized


def _hf(row: torch.Tensor, ids, r: float) -> torch.Tensor:
    """Transformers' processor on one raw row, ``ids`` the prompt and the output so far."""
    return RepetitionPenaltyLogitsProcessor(r)(torch.tensor([list(ids)]), row.float()[None].clone())[0]


def _rule(row: torch.Tensor, prompt, output, p: SamplingParams) -> torch.Tensor:
    """The whole rule on one raw row: transformers' repetition penalty over prompt + output,
    then presence and frequency over the output, then the bias (tests/test_penalties.py)."""
    return _penalized(_hf(row, [*prompt, *output], p.repetition_penalty), output, p)


def _tables(prompts, outputs, vocab: int, rows_B: torch.Tensor) -> StepCounts:
    """Count and mark tables whose row ``rows_B[i]`` holds ``prompts[i]`` and ``outputs[i]``."""
    pc = PenaltyCounts(int(rows_B.max()) + 1, vocab, "cpu")
    pc.mark_prompts(zip(rows_B.tolist(), prompts, strict=True))
    for row, out in zip(rows_B.tolist(), outputs, strict=True):
        for t in out:
            pc.table_RV[row, t] += 1
            pc.seen_RV[row, t] = True
    return pc.step(rows_B, counts=True, seen=True)


def _params(r: int) -> SamplingParams:
    reps = (1.3, 0.7, 2.0, 1.0, 1.05)
    return SamplingParams(temperature=0.0 if r % 3 else 0.8, seed=r, top_k=r % 4,
                          repetition_penalty=reps[r % 5],
                          presence_penalty=0.6 if r % 4 == 1 else 0.0, frequency_penalty=-0.4 if r % 6 == 1 else 0.0,
                          logit_bias=((r % 40, 1.5),) if r % 7 == 0 else ())


def test_every_adjusted_row_is_transformers_processor_then_the_other_penalties():
    rows, vocab = ROW_CHUNK + 16, 40
    torch.manual_seed(7)
    logits = torch.randn(rows, vocab) * 3
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, vocab, (1 + r % 7,), generator=g).tolist() for r in range(rows)]
    outputs = [torch.randint(0, vocab, (r % 5,), generator=g).tolist() for r in range(rows)]
    rows_B = torch.randperm(rows + 3, generator=g)[:rows]
    params = [_params(r) for r in range(rows)]
    counts = _tables(prompts, outputs, vocab, rows_B)
    adjusted = [r for r, p in enumerate(params) if p.adjusted]
    assert len(adjusted) > ROW_CHUNK  # two chunks
    got = {}
    for part, _, x_CV in adjusted_chunks(logits, adjusted, params, counts, ROW_CHUNK):
        got.update({row: x_CV[j].clone() for j, row in enumerate(part)})
    alone = 0
    for r in adjusted:
        p, want = params[r], _rule(logits[r], prompts[r], outputs[r], params[r])
        if not (p.penalized or p.logit_bias):  # exactly transformers' float32 values
            alone += 1
            assert torch.equal(got[r], _hf(logits[r], prompts[r] + outputs[r], p.repetition_penalty)), r
        torch.testing.assert_close(got[r], want, rtol=0, atol=1e-5)
    assert alone > 20
    # The draw: every row chooses what the rule gives, the raw logits untouched.
    raw = logits.clone()
    indices = [len(o) for o in outputs]
    drawn = draw_tokens(logits, params, indices, counts=counts)
    assert torch.equal(logits, raw)
    by_hand = torch.stack([_rule(logits[r], prompts[r], outputs[r], p) for r, p in enumerate(params)])
    plain = [dataclasses.replace(p, repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0,
                                 logit_bias=()) for p in params]
    assert drawn.ids_B.tolist() == draw_tokens(by_hand, plain, indices).ids_B.tolist()


def test_repetition_comes_before_presence_and_a_token_only_in_the_prompt_is_penalized():
    logits = torch.tensor([[2.0, -1.0, 1.9, 0.5]])
    counts = _tables([[1, 2]], [[0]], 4, torch.zeros(1, dtype=torch.int64))
    p = SamplingParams(repetition_penalty=2.0, presence_penalty=1.0)
    (_, _, x), = adjusted_chunks(logits, [0], [p], counts, ROW_CHUNK)
    # token 0 (output): 2 / 2 - 1 = 0, not (2 - 1) / 2; tokens 1, 2 (prompt only): -1 * 2, 1.9 / 2
    assert torch.equal(x[0], torch.tensor([0.0, -2.0, 0.95, 0.5]))
    assert draw_tokens(logits, [p], [1], counts=counts).ids_B.tolist() == [2]
    with pytest.raises(ValueError, match="row 0 has a repetition penalty and no StepCounts marks"):
        draw_tokens(logits, [p], [1], counts=dataclasses.replace(counts, seen_RV=None))


def test_marks_reset_to_the_whole_prompt_and_each_step_marks_its_tokens():
    pc = PenaltyCounts.for_runtime(3, 6, "cpu")
    assert pc.seen_RV.shape == (4, 6) and pc.seen_RV.dtype == torch.bool
    pc.seen_RV[2] = True  # an earlier request's marks
    pc.mark_prompts([(2, (1, 1, 4)), (3, (0,))])
    want = torch.zeros(4, 6, dtype=torch.bool)
    want[2, [1, 4]] = want[3, 0] = True
    assert torch.equal(pc.seen_RV, want)
    counts = pc.table_RV.clone()
    step = pc.step(torch.tensor([3, 2, 1]), counts=False, seen=True)
    step.record(torch.tensor([5, 1, 2]))
    want[3, 5] = want[1, 2] = True
    assert torch.equal(pc.seen_RV, want) and torch.equal(pc.table_RV, counts)  # no count read: none written
    assert torch.equal(step.seen(torch.tensor([1, 0])), want[[2, 3]])
    pc.step(torch.tensor([1]), counts=True, seen=False).record(torch.tensor([3]))
    assert torch.equal(pc.seen_RV, want) and pc.table_RV[1, 3] == 1


@pytest.mark.parametrize("value", [0, -1.2, float("nan"), float("inf"), True, "1.1"])
def test_a_bad_value_names_the_field_and_the_rule(value):
    with pytest.raises(ValueError) as info:
        SamplingParams(repetition_penalty=value)
    assert str(info.value) == f"SamplingParams.repetition_penalty must be a finite number > 0 (1: off), got {value!r}"
    assert SamplingParams(repetition_penalty=1).adjusted is False
    assert SamplingParams(repetition_penalty=50.0).repeats_penalized  # no upper limit (vLLM's rule)


# -- a rank ---------------------------------------------------------------------------------------

CHUNK = 24
SAMPLING = {"rep": dict(repetition_penalty=2.0), "low": dict(repetition_penalty=0.6),
            "mixed": dict(repetition_penalty=1.3, frequency_penalty=0.5, logit_bias=((7, 1.0),)),
            "sampled": dict(repetition_penalty=1.5, temperature=0.9, seed=4, top_k=20),
            "pres": dict(presence_penalty=1.5), "plain": {}}


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _requests() -> list[Request]:
    # "rep"'s prompt spans three chunks (its first chunk's tokens must count too).
    lens = {"rep": 2 * CHUNK + 10, "low": 9, "mixed": 30, "sampled": 14, "pres": 11, "plain": 8}
    return [Request(rid, _prompt(n, i), SamplingParams(max_new_tokens=12, **SAMPLING[rid]))
            for i, (rid, n) in enumerate(lens.items())]


def _serve(reqs: list[Request], running: int, overlap: bool = True):
    spec = RankSpec.create("tiny", dp_size=1, device="cpu", dtype="float32", max_running_requests=running,
                           chunked_prefill_size=CHUNK, max_context_len=96, attention="sdpa", overlap_schedule=overlap)
    with RankWorker(spec, keep_logits=True) as w:
        return {r.rid: r for r in w.generate(reqs)}, w.sampled_logits


def _step_by_step(req: Request, rows) -> list[int]:
    """The request's tokens chosen from its kept raw rows, the rule applied on the host."""
    sp, out = req.sampling, []
    plain = dataclasses.replace(sp, repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0,
                                logit_bias=())
    for row in rows:
        x = _rule(row, req.prompt_ids, out, sp)
        out.append(draw_tokens(x[None], [plain], [len(out)]).ids_B.item())
    return out


@pytest.fixture(scope="module")
def runs():
    return _serve(_requests(), 6), _serve(_requests(), 6, overlap=False)


def test_each_request_follows_the_rule_step_by_step_beside_other_rows(runs):
    # Six requests in the same steps (their prompts in chunks beside decode rows): each one,
    # "pres" and "plain" too, follows its own rule alone (no row reads another's marks).
    (got, logits), (step_by_step, _) = runs
    for req in _requests():
        assert list(got[req.rid].output_ids) == _step_by_step(req, logits[req.rid]), req.rid
        assert got[req.rid].output_ids == step_by_step[req.rid].output_ids, req.rid  # overlap: in flight marked
    assert got["low"].output_ids != got["rep"].output_ids


def test_the_prompt_s_tokens_are_penalized_every_chunk_s(runs):
    # Steps where "rep"'s raw argmax was a token of its prompt alone (not yet in its output),
    # which the penalty moved; one of them from the prompt's first chunk alone.
    (got, logits), _ = runs
    req = next(r for r in _requests() if r.rid == "rep")
    prompt, out = req.prompt_ids, got["rep"].output_ids
    moved = [int(row.argmax()) for i, row in enumerate(logits["rep"])
             if int(row.argmax()) in prompt and int(row.argmax()) not in out[:i] and out[i] != int(row.argmax())]
    assert moved
    assert any(t in prompt[:CHUNK] and t not in prompt[CHUNK:] for t in moved), moved


def test_a_reused_request_row_starts_from_its_own_prompt():
    # One request row: "a" marks it with its prompt and output, "b" (another prompt) takes it
    # over; marks left from "a" would have moved "b"'s tokens.
    a = Request("a", _prompt(40, 5), SamplingParams(max_new_tokens=10, repetition_penalty=3.0))
    b = Request("b", _prompt(6, 6), SamplingParams(max_new_tokens=10, repetition_penalty=3.0))
    got, logits = _serve([a, b], 1)
    assert list(got["a"].output_ids) == _step_by_step(a, logits["a"])
    assert list(got["b"].output_ids) == _step_by_step(b, logits["b"])
    stale = dataclasses.replace(b, prompt_ids=a.prompt_ids + got["a"].output_ids + b.prompt_ids)
    assert _step_by_step(stale, logits["b"]) != list(got["b"].output_ids)


def test_the_one_launch_form_equals_the_torch_form():
    # adjust_triton (Triton's interpreter here, CUDA on a GPU rank) against the torch ops, chunk
    # by chunk: rows with each penalty alone, all of them, none (r = 1, f = p = 0) and a bias.
    torch.manual_seed(7)
    vocab, rows = 300, 7
    logits = torch.randn(rows, vocab) * 3
    pc = PenaltyCounts(rows + 3, vocab, "cpu")
    pc.table_RV.copy_(torch.randint(0, 3, pc.table_RV.shape).float() * (torch.rand(pc.table_RV.shape) < 0.2))
    pc.seen_RV.copy_(torch.rand(pc.seen_RV.shape) < 0.3)
    counts = pc.step(torch.randperm(rows + 3)[:rows], counts=True, seen=True)
    params = [SamplingParams(repetition_penalty=(1.3, 1.0, 0.7, 2.0)[i % 4], frequency_penalty=(0.3, 0.0, -0.7)[i % 3],
                             presence_penalty=(0.0, 0.5)[i % 2], logit_bias=((i, 4.0),) if i == 5 else ())
              for i in range(rows)]
    adjusted = [i for i, p in enumerate(params) if p.adjusted]
    torch_form = [x.clone() for _, _, x in adjusted_chunks(logits, adjusted, params, counts, 3)]
    launched = [x.clone() for _, _, x in adjusted_chunks(logits, adjusted, params, counts, 3, use_triton=True)]
    assert len(launched) == 3
    for a, b in zip(launched, torch_form, strict=True):
        assert torch.equal(a, b)
    assert not torch.equal(torch_form[0], logits[adjusted[:3]])  # the penalties changed the rows
