"""How a model's weights are quantized: a checkpoint's ``quantization_config`` read (or refused),
or ``--quantization fp8`` applied to a float checkpoint or a preset.

One format is served: FP8 e4m3 weights in 128 x 128 blocks with float32 ``weight_scale_inv``
and dynamic (per-token, 1 x 128) activation scales, the format of DeepSeek-V3's and Qwen3's FP8
releases (``fp8_blocks``). Anything else is refused naming the field and the value, never served
wrong. Which weights are quantized: the attention projections (q, k, v, o), the experts' and the
dense MLPs' gate/up/down, except modules ``modules_to_not_convert`` names; embeddings, norms, the
router and the LM head stay in the model dtype.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from dp_runtime.model.config_parts import ModelConfigError

__all__ = ["QUANTIZATION_CHOICES", "QuantConfig", "quant_config_from_hf", "with_quantization"]

# ``--quantization``: none keeps the weights as the checkpoint stores them (an FP8 checkpoint is
# served FP8, as vLLM does without the option); fp8 quantizes float weights at load.
QUANTIZATION_CHOICES = ("none", "fp8")
_BLOCK = [128, 128]


@dataclass(frozen=True)
class QuantConfig:
    """FP8 block quantization: ``block`` (rows, columns) of a scale, the modules kept in the
    model dtype, and where the FP8 values come from (``checkpoint``, or ``online``: quantized at
    load from float weights)."""

    method: str = "fp8"
    block: tuple[int, int] = (128, 128)
    modules_to_not_convert: tuple[str, ...] = ()
    source: str = "checkpoint"

    def __post_init__(self) -> None:
        object.__setattr__(self, "block", tuple(self.block))
        object.__setattr__(self, "modules_to_not_convert", tuple(self.modules_to_not_convert))

    def skips(self, module: str) -> bool:
        """Whether ``module`` (a dotted name without ``.weight``) stays unquantized: an entry of
        ``modules_to_not_convert`` equal to it, one of its dotted prefixes, or a dotted suffix of
        it (``lm_head``, ``model.layers.3.mlp.experts``, ``mlp.gate``)."""
        return any(module == m or module.startswith(m + ".") or module.endswith("." + m)
                   for m in self.modules_to_not_convert)


def _fail(field: str, value: Any, why: str, source: str) -> ModelConfigError:
    return ModelConfigError(f"{source}: quantization_config.{field}={value!r} {why}")


def quant_config_from_hf(qc: Any, source: str = "config.json") -> QuantConfig:
    """The QuantConfig of a ``quantization_config`` object; ModelConfigError naming the field
    and the value for any other method, format, block size or activation scheme."""
    if not isinstance(qc, dict):
        raise ModelConfigError(f"{source}: quantization_config must be an object, got {qc!r}")
    method = qc.get("quant_method")
    if method != "fp8":
        raise _fail("quant_method", method,
                    "is not supported (supported: fp8 with 128x128 weight blocks)", source)
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise _fail("fmt", fmt, "is not supported (supported: e4m3)", source)
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise _fail("activation_scheme", scheme,
                    "is not supported (supported: dynamic, per-token 1x128 activation scales)",
                    source)
    block = qc.get("weight_block_size")
    if block != _BLOCK:
        raise _fail("weight_block_size", block,
                    "is not supported (supported: [128, 128]; per-tensor FP8 checkpoints have "
                    "none)", source)
    skip = qc.get("modules_to_not_convert") or qc.get("ignored_layers") or []
    if not isinstance(skip, list) or not all(isinstance(m, str) for m in skip):
        raise _fail("modules_to_not_convert", skip, "must be a list of module names", source)
    return QuantConfig(block=tuple(block), modules_to_not_convert=tuple(skip))


def with_quantization(cfg: Any, quantization: str) -> Any:
    """``cfg`` (a ModelConfig) as ``--quantization`` serves it: ``none`` leaves it (an FP8
    checkpoint stays FP8); ``fp8`` quantizes float weights at load (an FP8 checkpoint is
    already). ValueError naming the option for another value."""
    if quantization not in QUANTIZATION_CHOICES:
        raise ValueError(f"--quantization must be one of {', '.join(QUANTIZATION_CHOICES)}, "
                         f"got {quantization!r}")
    if quantization == "none" or cfg.quantization is not None:
        return cfg
    return replace(cfg, quantization=QuantConfig(source="online"))
