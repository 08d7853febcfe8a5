"""What ModelConfig and the config.json reader (``hf_config``) both need, in a module below both
so neither imports the other's importer: ModelConfigError, the one error type of a model that
cannot be loaded as given, and YarnScaling, YaRN's rotary parameters."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ModelConfigError", "YarnScaling"]


class ModelConfigError(ValueError):
    """A model that cannot be loaded as given: an unknown preset, a config.json that is not JSON,
    of an unsupported architecture or with a field the model cannot compute, a checkpoint
    with a missing, mis-shaped, non-float or unreadable tensor. The message names the file, the
    field or tensor, and the value: a launcher prints it as one line (a user error, exit 2)."""


@dataclass(frozen=True)
class YarnScaling:
    """YaRN rotary scaling, resolved as transformers resolves ``rope_type: yarn``: ``factor`` of
    context extension over ``original_max_position_embeddings``, the ``beta_fast``/``beta_slow``
    rotation bounds of the ramp between interpolated and original frequencies, and the
    ``attention_factor`` that scales cos and sin (from ``mscale``/``mscale_all_dim`` or
    ``0.1 ln(factor) + 1`` when the config gives none)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 1.0
    truncate: bool = True

    def __post_init__(self) -> None:
        if not self.factor >= 1.0:
            raise ModelConfigError(f"YaRN factor must be >= 1, got {self.factor}")
        if self.original_max_position_embeddings <= 0:
            raise ModelConfigError(
                f"YaRN original_max_position_embeddings must be > 0, "
                f"got {self.original_max_position_embeddings}")
        if not self.attention_factor > 0:
            raise ModelConfigError(
                f"YaRN attention_factor must be > 0, got {self.attention_factor}")
