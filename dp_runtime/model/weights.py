"""Weights of the reference model: from a Hugging Face checkpoint directory, or random.

Tensors keep their Hugging Face names (``model.layers.3.mlp.experts.17.up_proj.weight``). An EP rank
holds only its own experts and their scales (``dispatcher.partition.ExpertPartition``, the rule
every dispatcher uses) and reads only those from disk: safetensors opens files lazily, so a rank
touches the bytes of its experts and of the shared tensors, nothing else.

Errors are ModelConfigError and name the file (and the tensor): a tensor missing from every
file, a tensor whose shape differs from the config's or whose dtype is not a float type (an
integer tensor is never cast into a weight; an FP8 one needs the config's quantization_config and
its ``weight_scale_inv`` of the block grid's shape: ``fp8_blocks``), a shard that is
truncated or whose header is corrupt (safetensors checks that the header parses and that its
offsets cover the file exactly; flipped bytes inside tensor data have no checksum to catch), a
missing directory or shard, an index that is not valid JSON.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from pathlib import Path

import torch

from dispatcher.partition import ExpertPartition
from dp_runtime.model.checkpoint_files import checkpoint_index, open_shard
from dp_runtime.model.fp8_blocks import Fp8BlockWeight, scale_shape
from dp_runtime.model.model_config import ModelConfig, ModelConfigError
from dp_runtime.model.tensor_names import expert_names, layer_names

__all__ = ["FLOAT_DTYPES", "checkpoint_index", "expected_shapes", "iter_checkpoint", "iter_random",
           "load_weights", "random_weights"]

# safetensors dtype names a weight may be stored as (cast to the runtime dtype on load).
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")
FP8_SAFETENSORS = "F8_E4M3"  # a block-quantized weight, read with its weight_scale_inv


def expected_shapes(cfg: ModelConfig, ep_rank: int = 0,
                    ep_size: int = 1) -> dict[str, tuple[int, ...]]:
    """``{tensor name: shape}`` of everything rank ``ep_rank`` of ``ep_size`` holds."""
    part = ExpertPartition(cfg.num_experts, ep_size)
    h, hd = cfg.hidden_size, cfg.head_dim
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h),
                                       "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (cfg.vocab_size, h)
    first, n_local = part.first(ep_rank), part.num_local(ep_rank)
    q, kv, i_moe = cfg.num_heads * hd, cfg.num_kv_heads * hd, cfg.moe_intermediate_size
    role_shapes = {
        "attn_norm": (h,), "mlp_norm": (h,), "q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h),
        "o_proj": (h, q), "q_norm": (hd,), "k_norm": (hd,), "router": (cfg.num_experts, h),
        "mlp_gate": (cfg.intermediate_size, h), "mlp_up": (cfg.intermediate_size, h),
        "mlp_down": (h, cfg.intermediate_size), "q_bias": (q,), "k_bias": (kv,), "v_bias": (kv,),
        "o_bias": (h,),
    }
    for i in range(cfg.num_layers):
        for role, name in layer_names(cfg, i).items():
            out[name] = role_shapes[role]
        if cfg.is_sparse(i):
            for e in range(first, first + n_local):
                gate, up, down = expert_names(cfg, i, e)
                out[gate], out[up], out[down] = (i_moe, h), (i_moe, h), (h, i_moe)
    return out


def iter_checkpoint(
    path: str | Path,
    cfg: ModelConfig,
    ep_rank: int = 0,
    ep_size: int = 1,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> Iterator[tuple[str, torch.Tensor | Fp8BlockWeight]]:
    """Yield ``(name, tensor)`` for every tensor rank ``ep_rank`` holds, read from a Hugging Face
    safetensors checkpoint directory one file at a time (a consumer that copies each tensor into
    its own storage never holds more than one extra tensor). A float tensor comes cast to
    ``dtype``; an FP8 one (``F8_E4M3``, with ``quantization_config``) as an Fp8BlockWeight with
    its ``weight_scale_inv`` (the model stores it as it is, or dequantizes it).

    Checks every name, shape and dtype, and that every shard opens, before the first tensor is
    read; raises ModelConfigError naming the tensor and the directory when one is missing, the
    tensor, the file and both shapes when one is mis-shaped, the tensor, the file and its dtype
    when it is not a float type, an FP8 tensor's missing or mis-shaped scale, the file when a
    shard is truncated or corrupt.
    """
    want = expected_shapes(cfg, ep_rank, ep_size)
    files = checkpoint_index(path)
    missing = [name for name in want if name not in files]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ModelConfigError(
            f"tensor {missing[0]!r}{more} is in no safetensors file of {str(path)!r}")
    fp8 = _check_files(files, want,
                       lambda name, file, dtype: _check_dtype(cfg, path, files, name, file, dtype))
    scales = {_scale_name(n): scale_shape(want[n], cfg.quantization.block) for n in fp8}
    _check_files(files, scales, _check_scale_dtype)
    for file, names in _by_file(files, want).items():
        with open_shard(file) as f:
            for name in names:
                t = f.get_tensor(name)
                if name not in fp8:
                    yield name, t.to(device=device, dtype=dtype)
                    continue
                with open_shard(files[_scale_name(name)]) as g:
                    scale = g.get_tensor(_scale_name(name)).to(device=device, dtype=torch.float32)
                yield name, Fp8BlockWeight(t.to(device), scale, cfg.quantization.block)


def _scale_name(name: str) -> str:
    return name.removesuffix("weight") + "weight_scale_inv"


def _by_file(files: dict[str, Path], names) -> dict[Path, list[str]]:
    by_file: dict[Path, list[str]] = {}
    for name in names:
        by_file.setdefault(files[name], []).append(name)
    return by_file


def _check_files(files: dict[str, Path], want: dict[str, tuple[int, ...]], check_dtype) -> set[str]:
    """Check each tensor of ``want`` against its file (present, shape, ``check_dtype(name,
    dtype)``); returns the names ``check_dtype`` called FP8."""
    fp8: set[str] = set()
    for file, names in _by_file(files, want).items():
        with open_shard(file) as f:
            present = set(f.keys())
            for name in names:
                if name not in present:  # an index that names a file the tensor is not in
                    raise ModelConfigError(
                        f"tensor {name!r} is not in {str(file)!r}, where the index places it")
                meta = f.get_slice(name)
                shape = tuple(meta.get_shape())
                if shape != want[name]:
                    raise ModelConfigError(
                        f"tensor {name!r} in {str(file)!r} has shape {shape}; the config needs "
                        f"{want[name]}"
                    )
                if check_dtype(name, file, meta.get_dtype()):
                    fp8.add(name)
    return fp8


def _check_dtype(cfg: ModelConfig, path, files: dict[str, Path], name: str, file: Path,
                 dtype: str) -> bool:
    """Whether the tensor is FP8 (with its scale in the checkpoint); ModelConfigError if it is
    neither a float type nor an FP8 weight the config declares."""
    if dtype in FLOAT_DTYPES:
        return False
    where = f"{name!r} in {str(file)!r}"
    if dtype == FP8_SAFETENSORS and cfg.quantization is not None and name.endswith(".weight"):
        if _scale_name(name) not in files:
            raise ModelConfigError(f"tensor {where} is FP8 but its scale {_scale_name(name)!r} is "
                                   f"in no safetensors file of {str(path)!r}")
        return True
    why = ("FP8 tensors need quantization_config in config.json" if dtype == FP8_SAFETENSORS
           else "integer tensors are not cast and only FP8 (F8_E4M3) weights are dequantized")
    raise ModelConfigError(f"tensor {where} has dtype {dtype}; weights must be a float type "
                           f"({', '.join(FLOAT_DTYPES)}): {why}")


def _check_scale_dtype(name: str, file: Path, dtype: str) -> bool:
    if dtype not in FLOAT_DTYPES:
        raise ModelConfigError(f"scale {name!r} in {str(file)!r} has dtype {dtype}; a "
                               "weight_scale_inv must be a float type")
    return False


def load_weights(
    path: str | Path,
    cfg: ModelConfig,
    ep_rank: int = 0,
    ep_size: int = 1,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> dict[str, torch.Tensor]:
    """Read this rank's tensors from a Hugging Face safetensors checkpoint directory into a dict
    (errors: ``iter_checkpoint``)."""
    return dict(iter_checkpoint(path, cfg, ep_rank, ep_size, dtype, device))


def iter_random(
    cfg: ModelConfig,
    ep_rank: int = 0,
    ep_size: int = 1,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    seed: int = 0,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield deterministic random weights: each tensor is seeded by (seed, its name), so an
    expert has the same values on whichever rank holds it, and ranks agree with a world-size-1
    model. Drawn on ``device`` (a CUDA generator on GPU: a 30B-parameter model initialises in
    seconds), so values differ between a CPU and a GPU run of one seed."""
    device = torch.device(device)
    for name, shape in expected_shapes(cfg, ep_rank, ep_size).items():
        gen = torch.Generator(device=device).manual_seed(seed * 1_000_003
                                                         + zlib.crc32(name.encode()))
        t = torch.randn(shape, generator=gen, device=device, dtype=torch.float32)
        if name.endswith("norm.weight"):
            t = t.mul_(0.1).add_(1.0)
        else:
            t = t.mul_(shape[-1] ** -0.5)
        yield name, t.to(dtype)


def random_weights(
    cfg: ModelConfig,
    ep_rank: int = 0,
    ep_size: int = 1,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """``iter_random`` into a dict."""
    return dict(iter_random(cfg, ep_rank, ep_size, dtype, device, seed))
