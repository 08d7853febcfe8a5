"""A model too big for this machine's memory on CPU is refused before anything loads (issue 45
item 5): one line with the bytes needed and available, exit 2, no Ray, no weights."""

from __future__ import annotations

import re

import pytest

from launch.cli_errors import UsageError
from launch.host_memory import available_host_bytes, check_host_memory, host_bytes_needed
from tests.support.cli_probe import probe_cli


def _spec(model: str, device: str = "cpu", dp: int = 1):
    import torch

    from dp_runtime.rank_spec import RankSpec

    # float32 as the CLI's --dtype auto gives on CPU
    return RankSpec.create(model, device=device, dp_size=dp, ep_size=dp, dtype=torch.float32)


def test_qwen3_30b_on_this_cpu_is_refused_with_the_numbers_before_loading():
    need = sum(host_bytes_needed(_spec("qwen3-30b-a3b"), 1))
    available = available_host_bytes()
    if available is None or need <= available:
        pytest.skip(f"this machine holds qwen3-30b-a3b on CPU ({available} bytes available)")
    out = probe_cli([["run", "--model", "qwen3-30b-a3b", "--launcher", "local", "--device", "cpu"],
                     ["serve", "--model", "qwen3-30b-a3b", "--launcher", "local", "--device",
                      "cpu"]])
    for code, err in out["cases"]:
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1, err
        m = re.fullmatch(r"error: --model qwen3-30b-a3b: 1 CPU rank needs ([\d.]+) GiB of host "
                         r"memory \(weights ([\d.]+) GiB in float32, KV cache ([\d.]+) GiB\), more "
                         r"than the ([\d.]+) GiB available here \((\d+) > (\d+) bytes\); .*",
                         lines[0])
        # the KV table's rows follow the CLI's --max-running-requests default: not exactly `need`
        assert m and int(m.group(5)) > int(m.group(6)) and abs(int(m.group(5)) / need - 1) < 0.01
        assert float(m.group(1)) == round(int(m.group(5)) / 2**30, 2), lines[0]
        assert float(m.group(2)) > 100  # 30.5 B parameters in float32
    assert not out["ray"]


def test_two_ranks_count_twice_and_a_cuda_rank_is_not_the_host_s():
    one, two = _spec("tiny"), _spec("tiny", dp=2)
    w1, kv1 = host_bytes_needed(one, 1)
    w2, kv2 = host_bytes_needed(two, 2)
    assert kv2 == 2 * kv1 and w1 < w2 < 2 * w1  # EP: each of the two holds half the experts
    check_host_memory(two, 2, "tiny", available=w2 + kv2)  # exactly fits
    with pytest.raises(UsageError, match=rf"2 CPU ranks need .* \({w2 + kv2} > {w2 + kv2 - 1} "):
        check_host_memory(two, 2, "tiny", available=w2 + kv2 - 1)
    check_host_memory(_spec("qwen3-30b-a3b", device="cuda"), 1, "qwen3-30b-a3b", available=1)
