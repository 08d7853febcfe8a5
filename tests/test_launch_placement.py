"""The pure parts of placement and the process group: bundles, strategy, rank order, backend,
device index; and the group's teardown on a one-process gloo group."""

from __future__ import annotations

import pytest
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from launch.placement import assign_ranks, bundle_for, check_fits, choose_strategy
from launch.process_group import (
    backend_for,
    destroy_process_group,
    free_port,
    init_process_group,
    interface_of,
    local_cuda_index,
    pin_interfaces,
    store_socket,
)


def test_bundles():
    assert bundle_for("cuda") == {"CPU": 1.0, "GPU": 1.0}
    assert bundle_for("cpu", 2) == {"CPU": 2.0}
    with pytest.raises(ValueError, match="cpus_per_rank must be > 0"):
        bundle_for("cpu", 0)


def test_strategy_strict_pack_when_one_node_holds_every_rank():
    gpu = bundle_for("cuda")
    one_big = [{"CPU": 64.0, "GPU": 8.0}, {"CPU": 64.0, "GPU": 2.0}]
    assert choose_strategy(one_big, gpu, 8) == "STRICT_PACK"
    assert choose_strategy(one_big, gpu, 9) == "PACK"
    assert choose_strategy([{"CPU": 4.0}], bundle_for("cpu"), 2) == "STRICT_PACK"


def test_check_fits_names_the_need():
    check_fits([{"CPU": 2.0, "GPU": 1.0}, {"CPU": 2.0, "GPU": 1.0}], bundle_for("cuda"), 2)
    with pytest.raises(ValueError, match=r"cannot place 2 ranks of .*GPU.*room for 0.*GPU=0"):
        check_fits([{"CPU": 4.0}], bundle_for("cuda"), 2)


def test_ranks_follow_node_then_gpu():
    locations = [
        {"node_ip": "10.0.0.2", "gpu_ids": ["1"]},
        {"node_ip": "10.0.0.10", "gpu_ids": ["0"]},
        {"node_ip": "10.0.0.2", "gpu_ids": ["0"]},
        {"node_ip": "10.0.0.10", "gpu_ids": ["3"]},
    ]
    # 10.0.0.2 < 10.0.0.10 numerically (not as strings); then GPU ids within a node.
    assert assign_ranks(locations) == [1, 2, 0, 3]
    cpu = [{"node_ip": "1.1.1.1", "gpu_ids": []}] * 3
    assert assign_ranks(cpu) == [0, 1, 2]


def test_ranks_of_one_node_are_contiguous_when_nodes_share_an_ip():
    # Two nodes behind one IP (containers, Ray's test clusters): bundles placed interleaved.
    locations = [{"node_ip": "10.0.0.1", "node_id": node, "gpu_ids": []} for node in ("b", "a", "b", "a")]
    ranks = assign_ranks(locations)
    by_rank = [locations[ranks.index(r)]["node_id"] for r in range(4)]
    assert by_rank == ["a", "a", "b", "b"]


def test_backend_and_device_index():
    assert backend_for("cpu") == "gloo"
    assert backend_for("cuda") == "cpu:gloo,cuda:nccl"
    assert local_cuda_index(["3"], "3") == 0  # Ray narrowed the visible devices to the one GPU
    assert local_cuda_index([2], "0,1,2,3") == 2
    assert local_cuda_index(["5"], None) == 5
    with pytest.raises(ValueError, match="not in CUDA_VISIBLE_DEVICES"):
        local_cuda_index(["4"], "0,1")
    with pytest.raises(ValueError, match="no GPU was assigned"):
        local_cuda_index([], "0")
    assert 0 < free_port() < 65536


@pytest.fixture
def one_rank_group():
    init_process_group(0, 1, "127.0.0.1", free_port(), timeout_s=30.0)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_abort_tears_the_group_down(one_rank_group):
    destroy_process_group(abort=True)
    assert not dist.is_initialized()


def test_destroy_without_a_group_does_nothing():
    assert not dist.is_initialized()
    destroy_process_group()
    destroy_process_group(abort=True)
    assert not dist.is_initialized()


def test_abort_falls_back_to_destroy_on_a_torch_without_it(one_rank_group, monkeypatch):
    monkeypatch.delattr(c10d, "_abort_process_group")
    destroy_process_group(abort=True)
    assert not dist.is_initialized()


def test_abort_never_raises(one_rank_group, monkeypatch):
    def broken():
        raise RuntimeError("communicator already gone")

    monkeypatch.setattr(c10d, "_abort_process_group", broken)
    destroy_process_group(abort=True)  # the failure on its way out is the one to report


def test_gloo_and_nccl_listen_on_the_interface_of_the_node_address():
    pytest.importorskip("ray")  # psutil ships with Ray, where the launcher's ranks run
    env: dict[str, str] = {}
    name = pin_interfaces("127.0.0.1", env)
    assert name and env == {"GLOO_SOCKET_IFNAME": name, "NCCL_SOCKET_IFNAME": name}
    assert interface_of("127.0.0.1") == name
    mine = {"NCCL_SOCKET_IFNAME": "ib0"}  # the user's choice is kept
    assert pin_interfaces("127.0.0.1", mine) == name and mine["NCCL_SOCKET_IFNAME"] == "ib0"
    assert interface_of("203.0.113.7") is None  # no interface holds it: defaults apply
    with store_socket("127.0.0.1") as s:
        assert s.getsockname()[0] == "127.0.0.1"
