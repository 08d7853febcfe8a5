"""A dispatcher kind is its class (``dispatcher/kind.py``: facts and sizing) plus one row of the
factory's table: the rank's choices, the CLI's checks, the planner's and the runtime's sizing
read the class, so a new kind needs no other edit. Checked with a made-up kind added to the
table alone."""

from __future__ import annotations

import pytest
import torch

from dispatcher.factory import KINDS, auto_kind
from dispatcher.kind import DispatcherKind
from dp_runtime import memory_estimates as me
from dp_runtime import memory_sizing as ms
from dp_runtime.choices import resolve_choices


class EchoDispatcher(DispatcherKind):
    kind = "echo"
    capturable = False
    transient_workspace = True
    separate_expert_output = True
    auto_order = -1  # preferred by auto where it fits

    @classmethod
    def auto_reason(cls, world_size, flashinfer_dispatch, graphs_on_cuda):
        return "auto: echo fits 3 ranks" if world_size == 3 else None

    @classmethod
    def expert_rows(cls, dp_size, ep_size, num_tokens):
        return 3 * num_tokens

    @classmethod
    def workspace_bytes(cls, ep_size, max_tokens_per_rank, hidden_size, top_k, dtype):
        return 7 * max_tokens_per_rank


def _choose(dispatcher, world_size=2, graphs=False):
    return resolve_choices(dispatcher=dispatcher, use_cuda_graph=graphs, attention="sdpa", world_size=world_size,
                           device_type="cuda", dtype=torch.bfloat16, head_dim=128,
                           capture_sizes=(1, 2) if graphs else (), flashinfer_dispatch=(False, "no NVLink"),
                           flashinfer_importable=False)


def test_a_new_kind_is_its_class_and_one_table_row(monkeypatch):
    with pytest.raises(ValueError, match="dispatcher must be one of"):
        _choose("echo")
    monkeypatch.setitem(KINDS, "echo", EchoDispatcher)
    assert _choose("echo").dispatcher == "echo"
    with pytest.raises(ValueError, match=r"'echo' reads its counts on the host .*pick all_gather or flashinfer"):
        _choose("echo", graphs=True)
    assert auto_kind(3, (False, ""), False) == ("echo", "auto: echo fits 3 ranks")
    assert auto_kind(2, (False, "x"), False)[0] == "all_to_all"  # echo does not fit: the next one
    assert ms.dispatcher_workspace_bytes("echo", 2, 10, 64, 2, torch.float32) == 70
    assert ms.dispatcher_step_bytes("echo", 2, 5, 64, 2, torch.float32) == 35
    assert ms.dispatcher_transient("echo") and not ms.dispatcher_gathers("echo")
    assert me.expert_rows("echo", 2, 2, 4) == 12


def test_the_four_kinds_state_their_facts():
    facts = {k: (c.capturable, c.gathers, c.single_rank, c.cuda_only, c.transient_workspace) for k, c in KINDS.items()}
    assert facts == {"local": (True, False, True, False, False), "all_gather": (True, True, False, False, False),
                     "all_to_all": (False, False, False, False, True), "flashinfer": (True, False, False, True, False)}
    assert [me.expert_rows(k, 2, 4, 10) for k in KINDS] == [10, 20, 40, 40]
