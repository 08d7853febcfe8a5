"""RuntimeConfig: "auto" resolution, validation messages, env overrides, derived sizes."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dp_runtime.config import RuntimeConfig, align_up
from dp_runtime.env import read_env
from dp_runtime.sync.padding_mode import PaddingMode


def test_defaults_resolve_every_auto():
    c = RuntimeConfig(dp_size=4, attn_tp_size=2, max_running_requests=100)
    assert c.ep_size == 8
    assert c.cuda_graph_max_bs == 100  # min(100, 256), already a multiple of 2
    assert c.cuda_graph_bs[-1] == 100 and all(s % 2 == 0 for s in c.cuda_graph_bs)
    assert c.dtype is torch.bfloat16
    assert isinstance(c.device, torch.device)
    assert c.dp_padding is None
    assert c.dp_sync_exchange in ("auto", "shm", "gloo")
    assert "auto" not in (
        c.ep_size,
        c.cuda_graph_max_bs,
        c.cuda_graph_bs,
        c.dp_sync_shm_dir,
        str(c.device),
    )


def test_auto_extend_tokens_are_capped_by_the_largest_step():
    assert RuntimeConfig().cuda_graph_extend_tokens == (16, 32, 64, 128, 256, 384, 512, 768, 1024)
    # max_tokens_per_rank = max(chunked_prefill_size, max_running_requests) = 100
    assert RuntimeConfig(chunked_prefill_size=100, max_running_requests=8).cuda_graph_extend_tokens == (16, 32, 64)
    assert RuntimeConfig(chunked_prefill_size=8, max_running_requests=8).cuda_graph_extend_tokens == ()


def test_frozen():
    c = RuntimeConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.dp_size = 2  # type: ignore[misc]


def test_auto_graph_max_bs_rounds_down_to_attn_tp():
    c = RuntimeConfig(attn_tp_size=4, max_running_requests=30)
    assert c.cuda_graph_max_bs == 28
    c = RuntimeConfig(attn_tp_size=4, max_running_requests=3)
    assert c.cuda_graph_max_bs == 0 and c.cuda_graph_bs == ()


def test_derived_sizes():
    c = RuntimeConfig(dp_size=3, attn_tp_size=4, chunked_prefill_size=1001, max_running_requests=64)
    assert c.max_tokens_per_rank == 1004
    assert c.max_global_tokens == 3012
    assert c.world_size == 12


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"dp_size": 0}, ["dp_size must be an int >= 1", "dp_size=0"]),
        ({"attn_tp_size": -1}, ["attn_tp_size", "-1"]),
        ({"hidden_size": 0}, ["hidden_size", "0"]),
        ({"max_running_requests": 0}, ["max_running_requests", "0"]),
        ({"chunked_prefill_size": True}, ["chunked_prefill_size", "True"]),
        (
            {"dp_size": 2, "attn_tp_size": 2, "ep_size": 3},
            ["divides world_size", "ep_size=3", "world_size=4"],
        ),
        ({"ep_size": 0}, ["ep_size", "ep_size=0"]),
        (
            {"max_running_requests": 8, "cuda_graph_max_bs": 16},
            [
                "cuda_graph_max_bs must be an int in [0, max_running_requests]",
                "cuda_graph_max_bs=16",
                "max_running_requests=8",
            ],
        ),
        (
            {"attn_tp_size": 2, "cuda_graph_max_bs": 7},
            ["multiple of attn_tp_size", "cuda_graph_max_bs=7"],
        ),
        (
            {"cuda_graph_max_bs": 8, "cuda_graph_bs": (1, 4, 2, 8)},
            ["strictly increasing", "(1, 4, 2, 8)"],
        ),
        ({"cuda_graph_max_bs": 8, "cuda_graph_bs": (0, 8)}, ["> 0", "(0, 8)"]),
        (
            {"cuda_graph_max_bs": 8, "cuda_graph_bs": (1, 2, 4)},
            ["must equal cuda_graph_max_bs", "cuda_graph_max_bs=8"],
        ),
        (
            {"attn_tp_size": 2, "cuda_graph_max_bs": 8, "cuda_graph_bs": (2, 3, 8)},
            ["multiple of attn_tp_size", "unaligned=[3]"],
        ),
        (
            {"cuda_graph_max_bs": 0, "cuda_graph_bs": (1,)},
            ["no sizes iff 0", "cuda_graph_max_bs=0"],
        ),
        ({"cuda_graph_bs": "some"}, ['"auto" or a sequence', "'some'"]),
        ({"cuda_graph_extend_tokens": (16, 8)}, ["cuda_graph_extend_tokens must be strictly increasing", "(16, 8)"]),
        ({"cuda_graph_extend_tokens": (16, 16.5)}, ["cuda_graph_extend_tokens must hold ints", "16.5"]),
        (
            {"attn_tp_size": 2, "cuda_graph_extend_tokens": (16, 33)},
            ["every cuda_graph_extend_tokens size must be a multiple of attn_tp_size", "unaligned=[33]"],
        ),
        (
            {"chunked_prefill_size": 64, "max_running_requests": 8, "cuda_graph_extend_tokens": (16, 128)},
            ["must not exceed max_tokens_per_rank", "max_tokens_per_rank=64", "(16, 128)"],
        ),
        ({"cuda_graph_extend_tokens": "some"}, ['"auto" or a sequence of ints', "'some'"]),
        ({"dtype": "int8"}, ["dtype must be", "'int8'"]),
        ({"dtype": torch.int32}, ["dtype must be", "torch.int32"]),
        ({"dp_padding": "middle"}, ["padding mode 'middle'"]),
        ({"dp_sync_exchange": "tcp"}, ["dp_sync_exchange must be one of", "'tcp'"]),
        ({"dp_sync_timeout_s": 0}, ["dp_sync_timeout_s must be a number > 0", "=0"]),
    ],
)
def test_invalid_combinations_name_rule_and_values(kwargs, words):
    with pytest.raises(ValueError) as info:
        RuntimeConfig(**kwargs)
    for word in words:
        assert word in str(info.value)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, None),
        ("auto", None),
        ("AUTO", None),
        ("max_len", PaddingMode.MAX_LEN),
        ("SUM_LEN", PaddingMode.SUM_LEN),
        (PaddingMode.SUM_LEN, PaddingMode.SUM_LEN),
    ],
)
def test_padding_override_parsing(value, expected):
    assert RuntimeConfig(dp_padding=value).dp_padding is expected


@pytest.mark.parametrize(
    ("name", "dtype"),
    [("bf16", torch.bfloat16), ("float16", torch.float16), ("fp32", torch.float32)],
)
def test_dtype_names(name, dtype):
    assert RuntimeConfig(dtype=name).dtype is dtype


def test_env_replaces_auto_exchange_only(monkeypatch):
    monkeypatch.setenv("DP_RUNTIME_DP_SYNC_EXCHANGE", "gloo")
    assert RuntimeConfig().dp_sync_exchange == "gloo"
    assert RuntimeConfig(dp_sync_exchange="shm").dp_sync_exchange == "shm"
    monkeypatch.setenv("DP_RUNTIME_DP_SYNC_EXCHANGE", "pigeon")
    with pytest.raises(ValueError, match="DP_RUNTIME_DP_SYNC_EXCHANGE='pigeon'"):
        RuntimeConfig()


def test_env_shm_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("DP_RUNTIME_SHM_DIR", str(tmp_path))
    assert RuntimeConfig().dp_sync_shm_dir == str(tmp_path)
    assert read_env({}).shm_dir is None and read_env({}).dp_sync_exchange is None


def test_replace_revalidates():
    c = RuntimeConfig(dp_size=2)
    assert c.replace(dp_size=4, ep_size="auto").ep_size == 4
    with pytest.raises(ValueError, match="divides world_size"):
        c.replace(dp_size=3)  # ep_size stays at its resolved 2


def test_plan_fields_exclude_rank_local_values():
    a = RuntimeConfig(device="cpu", dp_sync_timeout_s=5)
    b = RuntimeConfig(device="meta", dp_sync_timeout_s=9)
    assert a.plan_fields() == b.plan_fields()
    assert a.plan_fields() != RuntimeConfig(cuda_graph_max_bs=8, cuda_graph_bs=(8,)).plan_fields()


@pytest.mark.parametrize("max_running_requests", [1, 3, 8, 9, 160, 256, 300, 512])
@pytest.mark.parametrize("attn_tp_size", [1, 2, 4])
def test_auto_capture_sizes(max_running_requests, attn_tp_size):
    c = RuntimeConfig(max_running_requests=max_running_requests, attn_tp_size=attn_tp_size)
    sizes, max_bs = c.cuda_graph_bs, c.cuda_graph_max_bs
    assert list(sizes) == sorted(set(sizes))
    assert max_bs == min(max_running_requests, 256) // attn_tp_size * attn_tp_size
    assert (sizes[-1] if sizes else 0) == max_bs
    assert all(s % attn_tp_size == 0 and 0 < s <= max_bs for s in sizes)


def test_align_up():
    assert [align_up(n, 4) for n in (0, 1, 4, 5, 8)] == [0, 4, 4, 8, 8]
