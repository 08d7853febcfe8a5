"""GPU specs by the names torch reports for devices (launch/gpu_specs.py)."""

from __future__ import annotations

import pytest

from launch.gpu_specs import GPUS, gpu_spec_for_device


@pytest.mark.parametrize(
    ("device_name", "key"),
    [
        ("NVIDIA H100 80GB HBM3", "h100"),
        ("NVIDIA H100 PCIe", "h100-pcie"),
        ("NVIDIA H200", "h200"),
        ("NVIDIA A100-SXM4-80GB", "a100-80gb"),
        ("NVIDIA A100-SXM4-40GB", "a100-40gb"),
        ("NVIDIA L40S", "l40s"),
        ("NVIDIA GeForce RTX 4090", "rtx-4090"),
    ],
)
def test_device_names_map_to_their_spec(device_name, key):
    assert gpu_spec_for_device(device_name) is GPUS[key]


@pytest.mark.parametrize("device_name", ["NVIDIA H100 NVL", "NVIDIA A100 80GB PCIe", "NVIDIA B200", "Tesla T4"])
def test_other_devices_have_no_spec(device_name):
    assert gpu_spec_for_device(device_name) is None


def test_every_spec_has_a_bandwidth():
    assert all(1e11 < spec.hbm_bytes_per_s < 1e13 for spec in GPUS.values())
