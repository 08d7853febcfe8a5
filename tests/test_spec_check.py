"""The RankSpec comparison across ranks: its pure parts (what is compared, the error) here;
real ranks under torchrun in ``test_rank_failure_dist.py``."""

from __future__ import annotations

import json
import struct

import pytest

from dp_runtime.rank_spec import RankSpec
from dp_runtime.sync.spec_check import (
    RankSpecMismatchError,
    checkpoint_digest,
    compare_spec_fields,
    spec_fields,
)


def _spec(**kw):
    return RankSpec.create("tiny", **{**dict(dp_size=2, device="cpu", dtype="float32"), **kw})


def _shard(path, tensors):
    header = json.dumps({k: {"dtype": d, "shape": list(s), "data_offsets": [0, 0]} for k, (d, s) in tensors.items()})
    path.write_bytes(struct.pack("<Q", len(header)) + header.encode())


@pytest.mark.parametrize(("changes", "field"), [
    (dict(dispatcher="all_to_all"), "RankSpec.dispatcher"),
    (dict(seed=1), "RankSpec.seed"),
    (dict(use_cuda_graph=False), "RankSpec.use_cuda_graph"),
    (dict(dtype="bfloat16"), "RuntimeConfig.dtype"),
    (dict(model_overrides={"num_layers": 1}), "RankSpec.model_overrides"),
    (dict(dp_sync_timeout_s=3.0), "RuntimeConfig.dp_sync_timeout_s"),
])
def test_a_differing_field_is_named_with_each_ranks_value(changes, field):
    a, b = spec_fields(_spec()), spec_fields(_spec(**changes))
    assert a != b
    compare_spec_fields([a, a])  # equal: nothing raised
    with pytest.raises(RankSpecMismatchError, match="DP ranks disagree on " + field.replace(".", r"\.")) as info:
        compare_spec_fields([a, a, b])
    assert info.value.field == field and info.value.ranks == (2,)


def test_other_differing_fields_are_listed():
    with pytest.raises(RankSpecMismatchError, match=r"Also differing: \['RankSpec.seed'\]"):
        compare_spec_fields([spec_fields(_spec()), spec_fields(_spec(dispatcher="all_gather", seed=3))])


def test_checkpoint_digest_sees_a_shape_a_dtype_and_a_broken_shard(tmp_path):
    base = {"a.weight": ("F32", (4, 8)), "b.weight": ("BF16", (8,))}
    digests = []
    for i, tensors in enumerate([base, base, {**base, "b.weight": ("BF16", (9,))}, {**base, "a.weight": ("I64", (4, 8))}]):
        d = tmp_path / f"ckpt{i}"
        d.mkdir()
        _shard(d / "model-00001.safetensors", tensors)
        digests.append(checkpoint_digest(d))
    assert digests[0] == digests[1]
    assert len(set(digests)) == 3
    broken = tmp_path / "ckpt1" / "model-00001.safetensors"
    broken.write_bytes(broken.read_bytes()[:12])  # truncated header
    assert checkpoint_digest(tmp_path / "ckpt1") != digests[0]
