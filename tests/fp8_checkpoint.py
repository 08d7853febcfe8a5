"""Tiny FP8 checkpoints in the format of Qwen's and DeepSeek's FP8 releases, and their float
reference.

``write_fp8_pair(root)`` writes a tiny float checkpoint with transformers, then two siblings:
``fp8/`` (each quantizable linear block-quantized: an ``F8_E4M3`` weight and a float32
``weight_scale_inv``, ``quantization_config`` in config.json, sharded with an index) and
``deq/`` (the same model with every quantized weight replaced by its dequantized values, float32):
transformers on ``deq/`` is the float32 reference an FP8 load must reproduce.

The shapes put every fused group on whole 128-row blocks (q 256, k/v 128, expert 128, dense
256 rows) so each one is stored FP8, and hidden 192 leaves a half block at the edge of K (and of
o_proj's N). ``modules_to_not_convert`` keeps the dense layer's ``mlp.down_proj`` in float.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from tests.hf_reference import write_tiny_checkpoint

FP8_QWEN = dict(hidden_size=192, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                moe_intermediate_size=128, intermediate_size=256)
FP8_MIXTRAL = dict(hidden_size=192, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                   intermediate_size=128)
QUANTIZED = re.compile(r"\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj|experts\.\d+\.\w+)\.weight$")
NOT_CONVERTED = ["model.layers.1.mlp.down_proj"]  # the dense layer of the Qwen checkpoint
QUANT_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": [128, 128]}


def write_fp8_pair(root: Path, family: str = "qwen3_moe", seed: int = 0) -> tuple[Path, Path, Path]:
    """``(float checkpoint, fp8 checkpoint, dequantized checkpoint)`` under ``root``."""
    from safetensors.torch import load_file, save_file

    from dp_runtime.model.fp8_blocks import dequantize_blocks, quantize_blocks

    dims = FP8_MIXTRAL if family == "mixtral" else FP8_QWEN
    src = write_tiny_checkpoint(root / "float", seed, family=family, **dims)
    fp8, deq = root / "fp8", root / "deq"
    for d in (fp8, deq):
        shutil.copytree(src, d)
    weight_map: dict[str, str] = {}
    for file in sorted(src.glob("*.safetensors")):
        tensors = load_file(str(file))
        q_out, d_out = {}, {}
        for name, t in tensors.items():
            module = name.removesuffix(".weight")
            if QUANTIZED.search(name) and module not in NOT_CONVERTED:
                values, scales = quantize_blocks(t)
                q_out[name], q_out[module + ".weight_scale_inv"] = values, scales
                d_out[name] = dequantize_blocks(values, scales)
            else:
                q_out[name] = d_out[name] = t
        save_file(q_out, str(fp8 / file.name), metadata={"format": "pt"})
        save_file(d_out, str(deq / file.name), metadata={"format": "pt"})
        weight_map.update({name: file.name for name in q_out})
    index = json.loads((src / "model.safetensors.index.json").read_text())
    index["weight_map"] = weight_map
    (fp8 / "model.safetensors.index.json").write_text(json.dumps(index))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {**QUANT_CONFIG, "modules_to_not_convert": NOT_CONVERTED}
    (fp8 / "config.json").write_text(json.dumps(config))
    return src, fp8, deq
