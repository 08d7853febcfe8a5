"""Presence and frequency penalties (``SamplingParams.presence_penalty`` / ``frequency_penalty``,
dp_runtime/serving/adjusted_rows.py).

The draw on CPU tensors: every row (greedy, sampled, biased, past a chunk) chooses what the
rule applied by hand gives, from the counts of a table on the device (``penalty_counts``); the
raw logits and the table are never written by the draw; presence and frequency differ as the
rule says. The table: a step counts its drawn tokens, and a request's first draw starts its row
from zero.

A rank (tiny preset, CPU, ``keep_logits``): a greedy request with penalties produces exactly
the greedy sequence of its kept raw rows with the rule applied on the host; its logprobs are
those raw rows'; a request without penalties in the same steps is unchanged; overlapped steps
(the token of the step before still in flight, counted by the device alone) give the tokens of
step-by-step serving; a request row reused by a new request starts from zero counts; the
table is the planned memory component."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
import torch

from dp_runtime import memory_sizing as ms
from dp_runtime.rank_spec import RankSpec
from dp_runtime.rank_worker import RankWorker
from dp_runtime.serving.penalty_counts import PenaltyCounts, StepCounts
from dp_runtime.serving.request import Request, SamplingParams
from dp_runtime.serving.sampling import ROW_CHUNK, draw_tokens


def _penalized(row: torch.Tensor, seen, p: SamplingParams) -> torch.Tensor:
    """The rule on one raw row: minus frequency * c and presence * (c > 0) for each token seen
    c times, then the bias."""
    x = row.float().clone()
    for tid, c in Counter(seen).items():
        x[tid] -= p.frequency_penalty * c + p.presence_penalty
    for tid, b in p.logit_bias:
        x[tid] += b
    return x


def _table(seen_per_row, vocab: int, rows_B: torch.Tensor) -> StepCounts:
    """A count table whose row ``rows_B[i]`` counts ``seen_per_row[i]``."""
    table = torch.zeros(int(rows_B.max()) + 1, vocab)
    for row, seen in zip(rows_B.tolist(), seen_per_row, strict=True):
        for tid, c in Counter(seen).items():
            table[row, tid] = c
    return StepCounts(table, rows_B)


def test_every_row_draws_from_the_rule_applied_by_hand():
    rows, vocab = ROW_CHUNK + 6, 40
    torch.manual_seed(5)
    logits = torch.randn(rows, vocab) * 2
    raw = logits.clone()
    g = torch.Generator().manual_seed(1)
    seen = [torch.randint(0, vocab, (r % 9,), generator=g).tolist() for r in range(rows)]
    rows_B = torch.randperm(rows + 3, generator=g)[:rows]  # request rows, not the step's order
    params = [None if r % 11 == 3 else SamplingParams(
        temperature=0.0 if r % 3 else 0.8, seed=r, top_k=r % 4,
        frequency_penalty=(r % 5 - 2) * 0.7, presence_penalty=(r % 7 - 3) * 0.6,
        logit_bias=((r % vocab, 1.5),) if r % 4 == 0 else ()) for r in range(rows)]
    indices = [len(s) for s in seen]
    counts = _table(seen, vocab, rows_B)
    table = counts.table_RV.clone()
    drawn = draw_tokens(logits, params, indices, counts=counts)
    assert torch.equal(logits, raw)  # the logprobs read these: they stay raw
    assert torch.equal(counts.table_RV, table)  # the draw reads the counts; record writes them
    by_hand = logits.clone()
    for r, p in enumerate(params):
        if p is not None:
            by_hand[r] = _penalized(logits[r], seen[r], p)
    plain = [None if p is None else dataclasses.replace(p, frequency_penalty=0.0, presence_penalty=0.0,
                                                        logit_bias=()) for p in params]
    assert drawn.ids_B.tolist() == draw_tokens(by_hand, plain, indices).ids_B.tolist()


def test_presence_and_frequency_differ_as_the_rule_says():
    logits = torch.tensor([[3.0, 2.0, 1.5, 0.0]])

    def greedy(seen, **pen):
        counts = _table([seen], 4, torch.zeros(1, dtype=torch.int64))
        return draw_tokens(logits, [SamplingParams(**pen)], [len(seen)], counts=counts).ids_B.item()

    # Token 0 generated three times: presence takes 0.9 once (3.0 -> 2.1, still first),
    # frequency 0.9 three times (3.0 -> 0.3: token 1 wins).
    assert greedy([0, 0, 0], presence_penalty=0.9) == 0
    assert greedy([0, 0, 0], frequency_penalty=0.9) == 1
    assert greedy([0], frequency_penalty=0.9) == 0 and greedy([], frequency_penalty=2.0) == 0
    assert greedy([1, 1], frequency_penalty=-0.6) == 1  # negative: repeats favoured (2 + 1.2)


def test_a_penalized_row_needs_its_counts():
    p = [SamplingParams(frequency_penalty=1.0)]
    with pytest.raises(ValueError, match="row 0 has a penalty and no StepCounts"):
        draw_tokens(torch.zeros(1, 8), p, [0])


def test_the_table_counts_each_steps_tokens_and_a_cleared_row_starts_from_zero():
    pc = PenaltyCounts.for_runtime(3, 6, "cpu")  # rows 0..3, row 0 the padding target
    assert pc.table_RV.shape == (4, 6) and pc.nbytes == 4 * 6 * (4 + 1)  # float32 counts, bool marks
    step = pc.step(torch.tensor([2, 1, 3]))
    step.record(torch.tensor([5, 0, 5]))
    step.record(torch.tensor([5, 4, 1]))
    want = torch.zeros(4, 6)
    want[2, 5], want[1, 0], want[1, 4], want[3, 5], want[3, 1] = 2, 1, 1, 1, 1
    assert torch.equal(pc.table_RV, want)
    assert torch.equal(step.rows(torch.tensor([2, 0])), want[[3, 2]])  # step rows 2 and 0
    pc.clear([1])
    want[1] = 0
    assert torch.equal(pc.table_RV, want)
    pc.close()
    assert pc.table_RV is None and pc.nbytes == 0


# -- a rank ---------------------------------------------------------------------------------------

PEN = {"freq": dict(frequency_penalty=2.0), "pres": dict(presence_penalty=2.0),
       "both": dict(frequency_penalty=-0.5, presence_penalty=1.5, logprobs=2)}


def _requests(penalties: bool) -> list[Request]:
    g = torch.Generator().manual_seed(11)
    out = []
    for i, rid in enumerate(("freq", "pres", "both", "plain", "sampled")):
        pen = PEN.get(rid, {}) if penalties else {}
        t = 0.8 if rid == "sampled" else 0.0
        sp = SamplingParams(max_new_tokens=14, temperature=t, seed=9, **pen)
        out.append(Request(rid, torch.randint(0, 256, (6 + 9 * i,), generator=g).tolist(), sp))
    return out


def _serve(penalties: bool, overlap: bool = True):
    spec = RankSpec.create("tiny", dp_size=1, device="cpu", dtype="float32", max_running_requests=4,
                           chunked_prefill_size=24, max_context_len=96, attention="sdpa", overlap_schedule=overlap)
    with RankWorker(spec, keep_logits=True) as w:
        return {r.rid: r for r in w.generate(_requests(penalties))}, w.sampled_logits


@pytest.fixture(scope="module")
def runs():
    return _serve(False), _serve(True), _serve(True, overlap=False)


def test_a_penalized_greedy_request_follows_the_rule_on_its_raw_rows(runs):
    _, (got, logits), _ = runs
    repeats_avoided = 0
    params = {r.rid: r.sampling for r in _requests(True)}
    for rid in PEN:
        sp = params[rid]
        want: list[int] = []
        for row in logits[rid]:
            want.append(int(_penalized(row, want, sp).argmax()))
            repeats_avoided += int(row.argmax()) in want[:-1] and want[-1] != int(row.argmax())
        assert list(got[rid].output_ids) == want, rid
    assert repeats_avoided  # the raw argmax was a token already produced, and the penalty moved it
    assert got["freq"].output_ids != got["pres"].output_ids or len(set(got["freq"].output_ids)) == 14


def test_the_logprobs_of_a_penalized_request_are_the_raw_rows(runs):
    _, (got, logits), _ = runs
    for tok, (lp, top), row in zip(got["both"].output_ids, got["both"].logprobs, logits["both"], strict=True):
        raw = torch.log_softmax(row, dim=-1)
        assert lp == pytest.approx(raw[tok].item(), abs=1e-6)
        assert [v for _, v in top] == pytest.approx(raw.topk(2).values.tolist(), abs=1e-6)


def test_requests_without_penalties_beside_penalized_ones_are_unchanged(runs):
    (plain, _), (got, _), _ = runs
    for rid in ("plain", "sampled"):
        assert got[rid].output_ids == plain[rid].output_ids
    assert any(got[rid].output_ids != plain[rid].output_ids for rid in PEN)


def test_overlapped_steps_count_the_token_in_flight(runs):
    _, (overlapped, _), (step_by_step, _) = runs
    for rid, res in step_by_step.items():
        assert overlapped[rid].output_ids == res.output_ids, rid


def _one_row_serve(reqs: list[Request], *, clear: bool = True):
    """Requests served on a rank with one request row: each reuses the row of the one before."""
    spec = RankSpec.create("tiny", dp_size=1, device="cpu", dtype="float32", max_running_requests=1,
                           chunked_prefill_size=24, max_context_len=96, attention="sdpa")
    with RankWorker(spec, keep_logits=True) as w:
        assert w.penalty_counts.table_RV.shape[0] == w.kv_cache.req_to_token.shape[0] == 2
        return {r.rid: r for r in w.generate(reqs)}, w.sampled_logits


def test_a_reused_request_row_starts_from_zero_counts():
    # One request row: "a" fills it with its counts, then "b" (the same prompt and penalties,
    # so its first raw argmax is a token "a" counted) and then "c" take it over. Each must follow
    # the rule from its own output alone: counts left from the row's last request would move
    # their tokens (a strong frequency and presence penalty on every token "a" drew).
    prompt = torch.randint(0, 256, (10,), generator=torch.Generator().manual_seed(3)).tolist()
    sp = SamplingParams(max_new_tokens=10, frequency_penalty=2.0, presence_penalty=2.0)
    reqs = [Request("a", prompt, sp), Request("plain", prompt[:7], SamplingParams(max_new_tokens=5)),
            Request("b", prompt, sp), Request("c", prompt, dataclasses.replace(sp, max_new_tokens=4))]
    got, logits = _one_row_serve(reqs)
    for rid in ("a", "b", "c"):
        want: list[int] = []
        for row in logits[rid]:
            want.append(int(_penalized(row, want, sp).argmax()))
        assert list(got[rid].output_ids) == want, rid
    assert got["b"].output_ids == got["a"].output_ids
    assert int(logits["b"][0].argmax()) in got["a"].output_ids  # stale counts would have mattered


def test_a_penalized_request_beside_unpenalized_ones_in_one_batch(runs):
    # max_running_requests 4: "freq" decodes in the same steps as "plain" and "sampled" (whose
    # rows the device counts too, unread); each keeps its own rule.
    (plain, _), (got, logits), _ = runs
    assert got["plain"].output_ids == plain["plain"].output_ids
    assert got["sampled"].output_ids == plain["sampled"].output_ids
    sp = PEN["freq"]
    want: list[int] = []
    for row in logits["freq"]:
        want.append(int(_penalized(row, want, SamplingParams(**sp)).argmax()))
    assert list(got["freq"].output_ids) == want


def test_the_count_table_is_a_planned_component():
    # The rank's measured component is the planner's term: (max_running_requests + 1) x V x
    # (4 + 1), the float32 counts and the repetition penalty's bool marks.
    spec = RankSpec.create("tiny", dp_size=1, device="cpu", dtype="float32", max_running_requests=3,
                           chunked_prefill_size=24, max_context_len=96, attention="sdpa")
    with RankWorker(spec) as w:
        got = w.memory_report()["penalty_counts"]
    assert got == ms.penalty_count_bytes(spec.runtime, 256) == 4 * 256 * (4 + 1)
    qwen = 151_936 * (4 + 1)
    for running, mib in ((64, 47.1), (256, 186.2)):
        from launch.planner import PlanInput, plan_capacity

        plan = plan_capacity(PlanInput(max_running_requests=running))
        assert plan.components.penalty_counts_bytes == (running + 1) * qwen
        assert abs(plan.components.penalty_counts_bytes / 2**20 - mib) < 0.1
