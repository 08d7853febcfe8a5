"""Mixed steps (RuntimeConfig.mixed_steps): the scheduler puts every decodable running request
into the prefill steps as decode rows, within the token budget; the model and both attention
backends run such a batch as one EXTEND forward; serving gives the tokens of serving without
mixed steps, which are transformers' greedy tokens."""

from __future__ import annotations

import pytest
import torch
from _graph_fixtures import make_eager_runner, make_stack
from flashinfer_emulator import emulated_flashinfer

from dp_runtime.config import RuntimeConfig
from dp_runtime.forward_mode import ForwardMode
from dp_runtime.rank_spec import RankSpec
from dp_runtime.rank_worker import RankWorker
from dp_runtime.serving.kv_allocator import KVAllocator
from dp_runtime.serving.kv_cache import KVCache
from dp_runtime.serving.paged_batches import extend_forward_batch
from dp_runtime.serving.request import Request, SamplingParams
from dp_runtime.serving.scheduler import Scheduler
from dp_runtime.sync.padding_mode import PaddingMode
from dp_runtime.sync.step_plan import plan_step
from dp_runtime.sync.step_table import LocalStepInfo, StepTable
from tests.hf_reference import greedy_reference, load_reference, write_tiny_checkpoint
from tests.support.small_scheduler import small_scheduler
from tests.support.synthetic_batch import add_requests, decode_batch, extend_batch


def _scheduler(budget: int = 8, *, mixed: bool = True, max_running: int = 4) -> Scheduler:
    return small_scheduler(num_slots=128, max_context_len=64, max_running=max_running, chunk=budget,
                           mixed_steps=mixed)


def _req(rid: str, prompt, new: int = 5, **sampling) -> Request:
    return Request(rid, list(prompt), SamplingParams(max_new_tokens=new, **sampling))


def _sampled(s: Scheduler, step, ids) -> None:
    """What the worker's sampling writes on the device: each row's token into last_tokens."""
    s.last_tokens[step.batch.req_pool_indices] = torch.tensor(ids)


def _rids(step) -> list[str]:
    return [r.request.rid for r in step.reqs]


# -- the scheduler -------------------------------------------------------------------------------
def test_prefill_steps_carry_the_decode_rows_within_the_budget_and_chunks_continue():
    s = _scheduler(budget=8)
    s.submit([_req("a", [1, 2, 3]), _req("b", [4, 5])])
    first = s.next_step()
    assert first.kind == "extend" and first.num_decode == 0 and first.samples == (True, True)
    _sampled(s, first, [21, 22])
    s.submit([_req("c", range(100, 110))])
    second = s.next_step()
    # a and b decode (1 token each, ids from the table) and c's first chunk takes the rest of 8.
    assert second.kind == "mixed" and second.batch.forward_mode is ForwardMode.EXTEND
    assert _rids(second) == ["a", "b", "c"] and second.num_new == (1, 1, 6) and second.num_decode == 2
    assert second.num_tokens == 8 and second.samples == (True, True, False)
    b = second.batch
    assert b.input_ids.tolist() == [21, 22, *range(100, 106)]
    assert b.positions.tolist() == [3, 2, *range(6)]
    assert b.extend_prefix_lens_cpu == (3, 2, 0) and b.extend_seq_lens_cpu == (1, 1, 6)
    assert b.seq_lens.tolist() == [4, 3, 6]
    assert torch.equal(s.cache.req_to_token[b.req_pool_indices.repeat_interleave(b.extend_seq_lens), b.positions],
                       b.out_cache_loc.to(torch.int32))
    _sampled(s, second, [31, 32, 0])
    third = s.next_step()  # c's last 4 tokens complete its prompt: it samples its first token
    assert third.kind == "mixed" and third.num_new == (1, 1, 4) and third.samples == (True, True, True)
    assert third.batch.input_ids.tolist() == [31, 32, *range(106, 110)]
    assert third.batch.positions.tolist() == [4, 3, *range(6, 10)]
    _sampled(s, third, [41, 42, 43])
    fourth = s.next_step()  # no prefill work: a DECODE batch (decode graphs serve it)
    assert fourth.kind == "decode" and fourth.batch.forward_mode is ForwardMode.DECODE
    assert fourth.batch.input_ids.tolist() == [41, 42, 43] and fourth.batch.positions.tolist() == [5, 4, 10]
    assert s.advance(first, [21, 22]) == [] and s.advance(second, [31, 32, None]) == []
    assert s.advance(third, [41, 42, 43]) == [] and s.advance(fourth, [51, 52, 53]) == []
    by_rid = {r.request.rid: r for r in s.running}
    assert by_rid["a"].output == [21, 31, 41, 51] and by_rid["c"].output == [43, 53]
    assert by_rid["a"].decode_steps == 3 and by_rid["c"].decode_steps == 1


def test_without_mixed_steps_a_prefill_stalls_the_running_requests():
    s = _scheduler(budget=8, mixed=False)
    s.submit([_req("a", [1, 2, 3]), _req("b", [4, 5])])
    first = s.next_step()
    s.submit([_req("c", range(100, 110))])
    steps = [s.next_step() for _ in range(3)]
    assert [st.kind for st in steps] == ["extend", "extend", "decode"]
    assert [_rids(st) for st in steps] == [["c"], ["c"], ["a", "b", "c"]]
    assert [st.num_new for st in steps[:2]] == [(8,), (2,)]
    assert first.kind == "extend"


def test_a_rank_whose_dp_peers_decode_keeps_its_prefill_to_the_mixed_budget():
    """With nothing of its own to decode a rank prefills whole chunks, unless a DP peer sampled
    in the last step (the rank worker says so): the ranks step together, so the chunk keeps to
    the mixed budget while the peer's requests wait. Without mixed steps nothing changes."""
    s = small_scheduler(num_slots=128, max_context_len=64, chunk=16, mixed_step_tokens=4)
    s.submit([_req("a", range(1, 41))])
    steps = [s.next_step()]
    s.note_peers_decoding(True)
    steps += [s.next_step(), s.next_step()]
    s.note_peers_decoding(False)
    steps.append(s.next_step())
    assert [st.num_new for st in steps] == [(16,), (4,), (4,), (16,)]
    assert [st.kind for st in steps] == ["extend"] * 4 and steps[-1].samples == (True,)
    plain = small_scheduler(num_slots=128, max_context_len=64, chunk=16, mixed_steps=False)
    plain.submit([_req("a", range(1, 41))])
    plain.note_peers_decoding(True)
    assert plain.next_step().num_new == (16,)


def test_decode_rows_that_fill_the_budget_leave_the_prefill_to_run_alone():
    # Two decode rows and a budget of 2: no room for a chunk, so the prefill runs as it would
    # without mixed steps (admission never starves behind the running requests).
    s = _scheduler(budget=2)
    s.submit([_req("a", [1]), _req("b", [2])])
    s.next_step()
    s.submit([_req("c", [7, 8, 9])])
    step = s.next_step()
    assert step.kind == "extend" and _rids(step) == ["c"] and step.num_new == (2,)
    s.submit([_req("d", [5])])
    step = s.next_step()  # still no room beside the decode rows: c's last token and d's prompt
    assert step.kind == "extend" and _rids(step) == ["c", "d"] and step.num_new == (1, 1)


def test_a_request_whose_last_token_is_in_flight_is_no_decode_row():
    s = _scheduler(budget=8)
    s.submit([_req("a", [1, 2], new=2)])
    first = s.next_step()  # a's first token in flight
    _sampled(s, first, [11])
    s.submit([_req("c", range(100, 114))])
    second = s.next_step()
    assert second.kind == "mixed" and _rids(second) == ["a", "c"] and second.num_new == (1, 7)
    _sampled(s, second, [12, 0])
    # a: 0 recorded + 2 in flight = max_new_tokens, so the next step has no decode row for it.
    third = s.next_step()
    assert third.kind == "extend" and _rids(third) == ["c"] and third.num_new == (7,)
    assert s.advance(first, [11]) == []
    (done,) = s.advance(second, [12, None])
    assert done.rid == "a" and done.output_ids == (11, 12) and done.finish_reason == "length"


def test_a_request_that_stops_while_its_mixed_step_is_scheduled_drops_that_token():
    s = _scheduler(budget=8)
    s.submit([_req("a", [1, 2], new=8, stop_token_ids=(9,))])
    first = s.next_step()
    _sampled(s, first, [9])
    s.submit([_req("c", range(100, 112), new=2)])
    second = s.next_step()  # scheduled before the host has read that a's first token stops it
    assert second.kind == "mixed" and _rids(second) == ["a", "c"]
    (done,) = s.advance(first, [9])
    assert done.output_ids == (9,) and done.finish_reason == "stop" and done.decode_steps == 1
    assert s.advance(second, [5, None]) == []  # a's row ran for nothing: its token is dropped
    third = s.next_step()  # a is gone: c's last chunk alone
    assert third.kind == "extend" and _rids(third) == ["c"] and third.num_new == (5,)
    _sampled(s, third, [61])
    fourth = s.next_step()
    assert s.advance(third, [61]) == []
    (c,) = s.advance(fourth, [62])
    assert c.output_ids == (61, 62) and c.finish_reason == "length"
    assert s.allocator.num_free_slots == s.cache.num_slots and not s.running


@pytest.mark.parametrize(("budget", "max_running"), [(8, 4), (3, 6)], ids=["budget>running", "budget<running"])
def test_no_step_brings_more_than_max_tokens_per_rank_and_every_request_finishes(budget, max_running):
    """Random prompts and lengths, tokens recorded one step late (overlap): a mixed step keeps
    to the budget, any step to max(budget, max_running) (the DP buffers' and the dispatcher
    workspace's max_tokens_per_rank), and every request ends with every slot back."""
    s = _scheduler(budget, max_running=max_running)
    g = torch.Generator().manual_seed(budget)
    n = 12
    lens = torch.randint(1, 14, (n,), generator=g).tolist()
    news = torch.randint(1, 6, (n,), generator=g).tolist()
    s.submit([_req(f"r{i}", range(1, 1 + ln), new=nw) for i, (ln, nw) in enumerate(zip(lens, news, strict=True))])
    limit = RuntimeConfig(chunked_prefill_size=budget, max_running_requests=max_running).max_tokens_per_rank
    done, pending, kinds = [], None, set()
    for _ in range(200):
        step = s.next_step()
        if step is None and pending is None:
            break
        if step is not None:
            kinds.add(step.kind)
            assert step.num_tokens <= limit
            assert step.kind != "mixed" or step.num_tokens <= budget
            _sampled(s, step, [7] * len(step.reqs))
        if pending is not None:
            done += s.advance(pending, [7 if x else None for x in pending.samples])
        pending = step
    assert sorted(r.rid for r in done) == sorted(f"r{i}" for i in range(n))
    assert all(len(r.output_ids) == nw for r, nw in zip(sorted(done, key=lambda r: int(r.rid[1:])), news, strict=True))
    assert "mixed" in kinds and s.allocator.num_free_slots == s.cache.num_slots


def test_mixed_batch_input_checks_name_the_fields():
    cache = KVCache(num_layers=1, num_kv_heads=1, head_dim=4, num_slots=32, max_reqs=4, max_context_len=16,
                    dtype=torch.float32, device="cpu")
    alloc = KVAllocator(cache)
    table = torch.zeros(5, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"decode_rows=1 .* extend length 1 \(got \[2\]\)"):
        extend_forward_batch(alloc, [0, 1], [3, 0], [2, 2], [1, 2], decode_rows=1, token_table=table)
    with pytest.raises(ValueError, match=r"decode_rows=1 .*token_table \(given: False\)"):
        extend_forward_batch(alloc, [0, 1], [3, 0], [1, 2], [1, 2], decode_rows=1)
    with pytest.raises(ValueError, match=r"3 input ids for 2 new tokens of known id"):
        extend_forward_batch(alloc, [0, 1], [3, 0], [1, 2], [1, 2, 3], decode_rows=1, token_table=table)
    with pytest.raises(ValueError, match=r"mixed_steps must be a bool \(got mixed_steps='on'\)"):
        RuntimeConfig(mixed_steps="on")


# -- the model and the attention backends --------------------------------------------------------
@pytest.mark.parametrize("backend", ["sdpa", "flashinfer", "flashinfer-paged"])
def test_a_mixed_batch_gives_the_logits_of_its_decode_and_extend_parts_run_apart(backend):
    """Decode rows (prefix > 0, one token) lead a batch with a continued chunk and a fresh one;
    the model samples one row per request (its last token) and each row equals what a decode
    step and an extend step of the same requests give on a copy of the same cache."""
    prefixes, chunks = [9, 17, 4], [5, 11]  # two decode rows, a continued chunk (prefix 4), a fresh one

    def stack():
        if backend == "sdpa":
            return make_stack()
        return make_stack(backend="flashinfer", deterministic=backend.endswith("paged"),
                          flashinfer_module=emulated_flashinfer())

    apart, together = stack(), stack()
    outs = []
    for st, mixed in ((apart, False), (together, True)):
        runner = make_eager_runner(st, max_bs=8, max_num_tokens=32)
        reqs = add_requests(st.allocator, prefixes, seed=5) + add_requests(st.allocator, [0], seed=6)
        if mixed:
            table = torch.zeros(st.cache.req_to_token.shape[0], dtype=torch.int64)
            table[[reqs[0].row, reqs[1].row]] = torch.tensor([7, 8])
            batch = extend_forward_batch(st.allocator, [r.row for r in reqs], [r.seq_len for r in reqs],
                                         [1, 1, *chunks], list(range(30, 46)), decode_rows=2, token_table=table)
            assert batch.input_ids[:2].tolist() == [7, 8]
            outs.append(runner.run(batch).clone())
            if backend == "flashinfer":  # the ragged layout attends the decode rows as decode rows
                assert st.backend.metadata.decode_rows == 2 and st.backend.metadata.decode is not None
        else:
            dec = runner.run(decode_batch(st.allocator, reqs[:2], [7, 8])).clone()
            ext = runner.run(extend_batch(st.allocator, reqs[2:], chunks, list(range(30, 46)))).clone()
            outs.append(torch.cat([dec, ext]))
    assert outs[1].shape == (4, apart.config.vocab_size)
    torch.testing.assert_close(outs[1], outs[0], atol=1e-4, rtol=1e-4)


def test_a_mixed_rank_beside_a_decoding_rank_plans_one_extend_step_within_the_limits():
    cfg = RuntimeConfig(dp_size=2, max_running_requests=8, chunked_prefill_size=32, cuda_graph_extend_tokens=(16, 32))
    mixed = LocalStepInfo(32, can_run_graph=True, is_extend=True)  # 8 decode rows + a 24-token chunk
    decoding = LocalStepInfo(8, can_run_graph=True)
    plan = plan_step(StepTable.from_locals([mixed, decoding]), cfg)
    assert plan.forward_modes == (ForwardMode.EXTEND, ForwardMode.DECODE) and plan.is_extend
    # Both ranks replay the extend pieces (the decoding rank's rows as one-token requests).
    assert plan.graph_bucket == 32 and plan.padding is PaddingMode.MAX_LEN and plan.global_dp_buffer_len == 64
    # A rank that cannot run a graph makes the step eager on every rank.
    plan = plan_step(StepTable.from_locals([mixed, LocalStepInfo(8)]), cfg)
    assert plan.graph_bucket is None
    assert plan.padding is PaddingMode.SUM_LEN and plan.global_dp_buffer_len == 40
    assert plan.global_dp_buffer_len <= cfg.max_global_tokens
    with pytest.raises(ValueError, match=r"num_tokens=33; it must be in \[0, max_tokens_per_rank=32\]"):
        plan_step(StepTable.from_locals([LocalStepInfo(33, is_extend=True), decoding]), cfg)


# -- serving -------------------------------------------------------------------------------------
pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_qwen3_moe_mixed"))


_LENS, _NEW = (5, 19, 33, 8, 12, 26), (9, 4, 6, 7, 3, 5)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in _LENS]


@pytest.fixture(scope="module")
def reference(ckpt, prompts):
    hf = load_reference(ckpt)
    return [greedy_reference(hf, p, n) for p, n in zip(prompts, _NEW, strict=True)]


def _serve(ckpt, prompts, *, mixed: bool, graphs: str):
    spec = RankSpec.create(str(ckpt), dp_size=1, max_running_requests=3, chunked_prefill_size=16, dtype="float32",
                           device="cpu", max_context_len=128, mixed_steps=mixed, use_cuda_graph=graphs != "eager",
                           cuda_graph_extend_tokens=(8, 16) if graphs == "extend-graphs" else ())
    reqs = [_req(f"r{i}", p, new=n) for i, (p, n) in enumerate(zip(prompts, _NEW, strict=True))]
    with RankWorker(spec, keep_logits=True) as w:
        results = w.generate(reqs)
        assert w.scheduler.kv_metrics()["free_kv_slots"] == w.kv_cache.num_slots
        return results, w.metrics(), w.sampled_logits


@pytest.mark.parametrize("graphs", ["eager", "graph-runner", "extend-graphs"])
def test_serving_with_mixed_steps_gives_the_tokens_without_them_and_transformers(ckpt, prompts, reference, graphs):
    plain, m_off, _ = _serve(ckpt, prompts, mixed=False, graphs=graphs)
    mixed, m_on, logits = _serve(ckpt, prompts, mixed=True, graphs=graphs)
    for a, b, (tokens, ref_logits) in zip(plain, mixed, reference, strict=True):
        assert a.output_ids == b.output_ids == tuple(tokens), a.rid
        torch.testing.assert_close(torch.stack(logits[b.rid]), ref_logits, rtol=1e-4, atol=1e-4)
    kinds_on, kinds_off = m_on["steps_by_kind"], m_off["steps_by_kind"]
    assert kinds_on["mixed"] > 0 and kinds_off["mixed"] == 0 and m_off["mixed_steps"] == 0
    for m, kinds in ((m_on, kinds_on), (m_off, kinds_off)):
        assert sum(kinds.values()) == m["steps"]  # one rank: every step forwarded, none idle
        assert m["extend_steps"] == kinds["extend"] + kinds["mixed"]
        assert m["prefill_tokens"] == sum(_LENS)
        assert m["decode_rows"] == sum(_NEW) - len(_NEW)  # every output token but the prefill's
        hist = m["tokens_per_step"]  # vllm:iteration_tokens_total: one observation per step
        assert hist["count"] == m["steps"] == hist["buckets"][-1]
        assert hist["sum"] == m["prefill_tokens"] + m["decode_rows"]
        # Decode steps run 1-3 rows (3 running at most); a step that prefills, at most 16 tokens
        # of prompt (the chunk) beside them: every step sits at or under le=32.
        assert dict(zip(hist["le"], hist["buckets"], strict=False))[32] == hist["count"]
    # Decode rows ride along the prefill: fewer steps than a prefill-or-decode schedule.
    assert m_on["steps"] < m_off["steps"]
    if graphs == "extend-graphs":
        assert m_on["extend_graph_steps"] > 0
    elif graphs == "graph-runner":
        assert m_on["graph_steps"] > 0

