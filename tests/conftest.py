"""Test tiers (see README.md, "Test tiers"): unit (plain pytest), `dist` (under torchrun, gloo), `gpu`
(one CUDA GPU), `gpu2` (two CUDA GPUs with NCCL, under torchrun) and `gpu4` (four CUDA GPUs with
NCCL, under torchrun with four ranks or more).

Under torchrun every rank collects the same tests and takes the same skip decisions, because
they depend only on the environment torchrun gives every rank alike and on the GPU count.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

# Without a GPU, Triton kernels run in Triton's CPU interpreter. Triton reads this when a kernel
# is defined, so it is set here, before any test module imports one.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


# Under torchrun only dist/gpu2/gpu4 tests run, and every rank imports every module it collects
# (all of tests/: transformers, fastapi, ray, ...), N ranks at once, in each of the three dist
# tiers. So under torchrun a test module is collected only if its text marks tests dist, gpu2 or
# gpu4; the unit run checks that every such test is in such a module (a marker applied some other
# way would be skipped silently by the dist tiers).
_MULTI_RANK_MARKS = ("mark.dist", "mark.gpu2", "mark.gpu4")
_MULTI_RANK_KEYWORDS = ("dist", "gpu2", "gpu4")


def _marks_multi_rank_tests(path: Path) -> bool:
    text = path.read_text(encoding="utf-8", errors="replace")
    return any(mark in text for mark in _MULTI_RANK_MARKS)


def pytest_ignore_collect(collection_path: Path, config) -> bool | None:
    if (under_torchrun() and collection_path.is_file() and collection_path.name.startswith("test_")
            and collection_path.suffix == ".py" and not _marks_multi_rank_tests(collection_path)):
        return True
    return None


def _check_multi_rank_marks_are_visible(items) -> None:
    unseen = sorted({str(item.path) for item in items
                     if any(item.get_closest_marker(k) for k in _MULTI_RANK_KEYWORDS)
                     and not _marks_multi_rank_tests(item.path)})
    if unseen:
        raise pytest.UsageError(f"dist/gpu2/gpu4 tests in modules without a literal "
                                f"{' or '.join(_MULTI_RANK_MARKS)}, which torchrun would not collect "
                                f"(tests/conftest.py): {unseen}")


def pytest_collection_modifyitems(config, items):
    launched = under_torchrun()
    if not launched:
        _check_multi_rank_marks_are_visible(items)
    ngpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    world = int(os.environ.get("WORLD_SIZE", "1"))
    skip_dist = pytest.mark.skip(reason="dist test: run under torchrun (see README)")
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_gpu2 = pytest.mark.skip(reason="needs 2 CUDA GPUs and torchrun with >= 2 ranks")
    skip_gpu4 = pytest.mark.skip(reason="needs 4 CUDA GPUs and torchrun with >= 4 ranks")
    for item in items:
        if "gpu4" in item.keywords:
            if ngpu < 4 or not launched or world < 4:
                item.add_marker(skip_gpu4)
        elif "gpu2" in item.keywords:
            if ngpu < 2 or not launched or world < 2:
                item.add_marker(skip_gpu2)
        elif "dist" in item.keywords:
            if not launched:
                item.add_marker(skip_dist)
        elif launched:
            # Under torchrun only dist/gpu2/gpu4 tests run: unit tests would run N times for
            # nothing.
            item.add_marker(pytest.mark.skip(reason="unit test: runs without torchrun"))
        if "gpu" in item.keywords and ngpu < 1:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def dist_group():
    """The default process group of this torchrun job: gloo for CPU tensors, NCCL for CUDA ones.

    Created once per session and destroyed once at its end (graphs and other users of the group
    must be gone by then: fixtures that hold them are function- or module-scoped).
    """
    if not under_torchrun():
        pytest.skip("needs torchrun")
    if not dist.is_initialized():
        rank = int(os.environ["RANK"])
        if torch.cuda.is_available() and torch.cuda.device_count() > 1:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
            backend = "cpu:gloo,cuda:nccl"
        else:
            backend = "gloo"
        dist.init_process_group(backend=backend, timeout=__import__("datetime").timedelta(seconds=120))
    yield dist.group.WORLD
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
