"""The device-side draw on a GPU: the distribution it draws from (min-p too), a seeded row's
tokens whatever its batch (CUDA generators), and no host synchronisation anywhere in a step's
draw (min-p, biased and penalized rows too, the repetition penalty's prompt marks included),
logprobs and their copies to the host (torch's sync debug mode raises on any synchronising
call)."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

from dp_runtime.serving.logprobs import logprob_rows
from dp_runtime.serving.penalty_counts import PenaltyCounts
from dp_runtime.serving.request import SamplingParams
from dp_runtime.serving.sampling import ROW_CHUNK, StepCounts, _top_p_threshold, draw_tokens
from dp_runtime.serving.top_p_search import top_p_thresholds
from tests import test_sampling as on_cpu  # a module, so its tests are not collected here too
from tests.test_penalties import _penalized  # the penalty rule by hand
from tests.test_sampling import LOGITS, _reference

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.7, top_p=0.8),
                                    SamplingParams(temperature=1.2, top_k=4, top_p=0.9),
                                    SamplingParams(temperature=1.0, min_p=0.3),
                                    SamplingParams(temperature=1.0, top_p=0.9, min_p=0.3)],
                         ids=["p", "k-p", "m", "p-m"])
def test_draws_follow_the_reference_distribution_on_the_gpu(params):
    n = 6000
    logits = LOGITS.cuda().expand(n, -1).contiguous()
    ids = draw_tokens(logits, [dataclasses.replace(params, seed=i) for i in range(n)], [0] * n).ids_B.cpu()
    want = _reference(LOGITS, params)
    got = torch.bincount(ids, minlength=LOGITS.numel()).double() / n
    assert torch.all(got[want == 0] == 0)
    assert torch.all((got - want).abs() <= 4.5 * (want * (1 - want) / n).sqrt() + 1e-12), f"{got} against {want}"


def test_a_seeded_row_draws_the_same_tokens_whatever_its_batch_on_the_gpu():
    vocab, size = 151_936, ROW_CHUNK + 9  # a real vocabulary; the row in the second chunk
    torch.manual_seed(0)
    steps = [torch.randn(vocab, device="cuda") * 3 for _ in range(3)]
    mine = SamplingParams(temperature=0.9, top_p=0.95, seed=11)
    alone = [draw_tokens(s[None], [mine], [i]).ids_B.item() for i, s in enumerate(steps)]
    batched = []
    for i, s in enumerate(steps):
        rows = torch.randn(size, vocab, device="cuda")
        rows[size - 1] = s
        params = [SamplingParams(temperature=1.0, top_k=50, seed=j) for j in range(size - 1)] + [mine]
        batched.append(draw_tokens(rows, params, [5] * (size - 1) + [i]).ids_B[size - 1].item())
    assert batched == alone


def test_the_kernel_keeps_the_kth_token_and_keys_its_noise_on_the_gpu(monkeypatch):
    # CUDA's float32 division is not the interpreter's: the threshold test must hold here too
    real = draw_tokens

    def on_gpu(logits, *args, **kw):
        return real(logits.cuda(), *args, **kw)

    monkeypatch.setattr("tests.test_sampling.draw_tokens", on_gpu)
    on_cpu.test_top_k_keeps_exactly_the_k_tokens_at_the_limits_of_float32("triton")
    on_cpu.test_each_token_of_a_request_and_each_seed_draw_their_own_noise("triton")


def test_the_top_p_search_finds_the_sorts_threshold_at_a_real_vocabulary():
    # 256 rows of qwen3's vocabulary: the search against the sort, and against the rule in
    # float64 where their float32 sums round apart (a mass within 1e-5 of top_p at the edge).
    rows, vocab = 256, 151_936
    torch.manual_seed(1)
    logits = torch.randn(rows, vocab, device="cuda") * torch.linspace(0.5, 12, rows, device="cuda")[:, None]
    logits[::7, : vocab // 2] = logits[::7, vocab // 2 :]  # ties
    temp = torch.rand(rows, device="cuda") * 1.4 + 0.1
    top_p = torch.rand(rows, device="cuda").clamp(1e-4, 0.999)
    got = top_p_thresholds(logits, torch.arange(rows, device="cuda"), temp, top_p)
    want = _top_p_threshold(logits.sort(dim=-1, descending=True).values, temp, top_p)
    for r in (got != want).nonzero()[:, 0].tolist():
        probs = torch.softmax(logits[r].double() / temp[r].double(), dim=-1)
        above, at = probs[logits[r] > got[r]].sum().item(), probs[logits[r] >= got[r]].sum().item()
        assert above < top_p[r].item() + 1e-5 and top_p[r].item() <= at + 1e-5, (r, above, at, top_p[r].item())
    assert (got == want).float().mean().item() >= 0.9
    for r in (0, 7, rows - 1):  # a row's threshold is its own, whatever its batch
        alone = top_p_thresholds(logits, torch.tensor([r], device="cuda"), temp[r : r + 1], top_p[r : r + 1])
        assert alone.item() == got[r].item()


@contextlib.contextmanager
def _never_waits():
    """Torch's sync debug mode raises on any synchronising call in the block; the block's work
    is done when it exits."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def test_a_draw_with_logprobs_never_waits_for_the_gpu():
    rows, vocab = 2 * ROW_CHUNK + 1, 151_936
    logits = torch.randn(rows, vocab, device="cuda")
    params = [SamplingParams(temperature=0.8, top_k=(i % 3) * 20, top_p=(0.9 if i % 2 else 1.0), logprobs=5,
                             min_p=0.05 * (i % 4), seed=i) for i in range(rows)]
    with _never_waits():
        drawn = draw_tokens(logits, params, list(range(rows)))
        lp = logprob_rows(logits, drawn.ids_B, range(rows), [5] * rows).to_host()
        host = torch.empty(rows, dtype=torch.int64, pin_memory=True).copy_(drawn.ids_B, non_blocking=True)
    assert not drawn.failed_R.any()
    got = lp.per_row()
    want = torch.log_softmax(logits, dim=-1)
    for r in (0, ROW_CHUNK, rows - 1):
        tok = host[r].item()
        assert got[r][0] == pytest.approx(want[r, tok].item(), abs=1e-5)
        assert [i for i, _ in got[r][1]] == want[r].topk(5).indices.tolist()


def test_a_biased_draw_never_waits_and_is_the_bias_added_by_hand_on_the_gpu():
    # Two chunks of biased rows beside unbiased ones, greedy and sampled, 300 entries a row: one
    # token forced (+100) per biased row, the rest pushed about; the logits stay raw.
    rows, vocab = ROW_CHUNK + 9, 151_936
    torch.manual_seed(1)
    logits = torch.randn(rows, vocab, device="cuda")
    raw = logits.clone()
    params = [SamplingParams(temperature=0.0 if i % 4 == 0 else 0.9, top_k=(i % 3) * 20, top_p=0.9 if i % 2 else 1.0,
                             seed=i, logit_bias=tuple((t * 499 + i, 100.0 if t == 0 else t % 7 - 3.0)
                                                      for t in range(300)) if i % 5 else ())
              for i in range(rows)]
    with _never_waits():
        drawn = draw_tokens(logits, params, list(range(rows)))
    ids = drawn.ids_B.tolist()
    assert torch.equal(logits, raw) and not drawn.failed_R.any()
    assert all(ids[i] == i for i in range(rows) if i % 5)
    by_hand, unbiased = on_cpu._with_bias_added(logits, params)
    assert ids == draw_tokens(by_hand, unbiased, list(range(rows))).ids_B.tolist()


def _step_rows(seed: int):
    """A penalty test's step: ``ROW_CHUNK + 9`` rows of logits over the real vocabulary (two
    chunks), a copy to check they stay raw, and a host generator for its ids."""
    rows, vocab = ROW_CHUNK + 9, 151_936
    torch.manual_seed(seed)
    logits = torch.randn(rows, vocab, device="cuda") * 3
    return rows, vocab, logits, logits.clone(), torch.Generator().manual_seed(seed + 2)


def test_a_penalized_draw_never_waits_and_is_the_rule_applied_by_hand_on_the_gpu():
    # Two chunks of penalized rows (some biased too) beside plain ones, greedy and sampled, each
    # with its counts in a table on the device (request rows shuffled against the step's), then
    # the step's tokens counted into it: no wait either.
    rows, vocab, logits, raw, g = _step_rows(2)
    recorded = [torch.randint(0, vocab, (40 + i,), generator=g).tolist() for i in range(rows)]
    rows_B = torch.randperm(rows + 5, generator=g)[:rows]
    table = torch.zeros(rows + 5, vocab)
    for row, seen in zip(rows_B.tolist(), recorded, strict=True):
        table[row].index_add_(0, torch.tensor(seen), torch.ones(len(seen)))
    counts = StepCounts(table.cuda(), rows_B.cuda())
    params = [SamplingParams(temperature=0.0 if i % 4 == 0 else 0.9, top_p=0.9 if i % 2 else 1.0, seed=i,
                             frequency_penalty=1.5 if i % 5 else 0.0, presence_penalty=-1.0 if i % 3 else 2.0,
                             logit_bias=((i, 5.0),) if i % 7 == 0 else ()) for i in range(rows)]
    indices = [len(s) for s in recorded]
    with _never_waits():
        drawn = draw_tokens(logits, params, indices, counts=counts)
        counts.record(drawn.ids_B)
    assert torch.equal(logits, raw) and not drawn.failed_R.any()
    by_hand = logits.clone()
    for i, p in enumerate(params):
        by_hand[i] = _penalized(logits[i], recorded[i], p)
    for row, tok in zip(rows_B.tolist(), drawn.ids_B.tolist(), strict=True):
        table[row, tok] += 1  # the draw's tokens counted after it
    assert torch.equal(counts.table_RV.cpu(), table)
    plain = [dataclasses.replace(p, frequency_penalty=0.0, presence_penalty=0.0, logit_bias=()) for p in params]
    assert drawn.ids_B.tolist() == draw_tokens(by_hand, plain, indices).ids_B.tolist()


def _repeated(row: torch.Tensor, ids, r: float) -> torch.Tensor:
    """The repetition penalty by hand (tests/test_repetition_penalty.py checks this rule against
    transformers' processor): each id of the prompt or output divided by r where positive,
    multiplied where not."""
    x = row.float().cpu()  # a copy on the host: one read, not one per id
    for t in set(ids):
        x[t] = x[t] / r if x[t] > 0 else x[t] * r
    return x


def test_a_repetition_penalized_draw_never_waits_and_is_the_rule_applied_by_hand_on_the_gpu():
    # Two chunks of rows with a repetition penalty (some with presence/frequency penalties and a
    # bias too) beside plain ones, greedy and sampled: half draw their first token (their marks
    # reset to their whole prompt in this step, one copy), half have earlier output marked; the
    # step's tokens then counted and marked. Nothing waits.
    rows, vocab, logits, raw, g = _step_rows(3)
    prompts = [torch.randint(0, vocab, (30 + 7 * i,), generator=g).tolist() for i in range(rows)]
    outputs = [[] if i % 2 else torch.randint(0, vocab, (5 + i,), generator=g).tolist() for i in range(rows)]
    rows_B = torch.randperm(rows + 5, generator=g)[:rows]
    pc = PenaltyCounts(rows + 5, vocab, "cuda")
    pc.seen_RV.fill_(True)  # an earlier request's marks everywhere: the first draws reset theirs
    pc.mark_prompts((row, p + o) for row, p, o, i in zip(rows_B.tolist(), prompts, outputs, range(rows), strict=True)
                    if i % 2 == 0)  # the rows drawing later tokens: their prompt and output already marked
    for row, out in zip(rows_B.tolist(), outputs, strict=True):
        pc.table_RV[row].index_add_(0, torch.tensor(out, dtype=torch.int64, device="cuda"),
                                    torch.ones(len(out), device="cuda"))
    params = [SamplingParams(temperature=0.0 if i % 4 == 0 else 0.9, top_p=0.9 if i % 2 else 1.0, seed=i,
                             repetition_penalty=(1.3, 0.8, 1.0, 2.0)[i % 4],
                             frequency_penalty=0.7 if i % 5 == 0 else 0.0,
                             presence_penalty=-0.5 if i % 3 == 0 else 0.0,
                             logit_bias=((i, 5.0),) if i % 7 == 0 else ()) for i in range(rows)]
    indices = [len(o) for o in outputs]
    rows_cuda = rows_B.cuda()  # a pageable copy waits: the step's rows are on the device already in a rank
    with _never_waits():
        pc.mark_prompts((row, prompts[i]) for i, row in enumerate(rows_B.tolist()) if i % 2)  # first draws
        counts = pc.step(rows_cuda, counts=True, seen=True)
        drawn = draw_tokens(logits, params, indices, counts=counts)
        counts.record(drawn.ids_B)
    assert torch.equal(logits, raw) and not drawn.failed_R.any()
    by_hand = logits.clone()
    for i, p in enumerate(params):
        by_hand[i] = _penalized(_repeated(logits[i], prompts[i] + outputs[i], p.repetition_penalty), outputs[i], p)
    plain = [dataclasses.replace(p, repetition_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0,
                                 logit_bias=()) for p in params]
    assert drawn.ids_B.tolist() == draw_tokens(by_hand, plain, indices).ids_B.tolist()
    for i, (row, tok) in enumerate(zip(rows_B.tolist(), drawn.ids_B.tolist(), strict=True)):
        want = torch.zeros(vocab, dtype=torch.bool)
        want[prompts[i] + outputs[i] + [tok]] = True
        assert torch.equal(pc.seen_RV[row].cpu(), want), i  # reset to the prompt, then marked
        assert pc.table_RV[row, tok].item() == outputs[i].count(tok) + 1


def test_the_one_launch_penalties_equal_the_torch_ops_on_the_gpu():
    # adjust_triton against the torch form on CUDA, a full vocabulary: the same values (a fused
    # multiply-add may round the frequency term once where torch rounds twice: one ulp at most).
    from dp_runtime.serving.adjusted_rows import adjusted_chunks

    torch.manual_seed(11)
    vocab, rows = 151_936, ROW_CHUNK + 5
    logits = torch.randn(rows, vocab, device="cuda") * 4
    pc = PenaltyCounts(rows + 3, vocab, "cuda")
    pc.table_RV.copy_(torch.randint(0, 4, pc.table_RV.shape, device="cuda").float()
                      * (torch.rand(pc.table_RV.shape, device="cuda") < 0.01))
    pc.seen_RV.copy_(torch.rand(pc.seen_RV.shape, device="cuda") < 0.01)
    counts = pc.step(torch.randperm(rows + 3, device="cuda")[:rows], counts=True, seen=True)
    params = [SamplingParams(repetition_penalty=(1.3, 1.0, 0.7)[i % 3], frequency_penalty=(0.3, 0.0)[i % 2],
                             presence_penalty=(0.0, 0.5, -0.2)[i % 3], logit_bias=((i, 3.0),) if i % 9 == 0 else ())
              for i in range(rows)]
    adjusted = [i for i, p in enumerate(params) if p.adjusted]
    for (_, _, a), (_, _, b) in zip(adjusted_chunks(logits, adjusted, params, counts, ROW_CHUNK, use_triton=True),
                                    adjusted_chunks(logits, adjusted, params, counts, ROW_CHUNK), strict=True):
        torch.testing.assert_close(a, b, rtol=2.0**-22, atol=1e-5)
        assert torch.equal(a.argmax(-1), b.argmax(-1))
