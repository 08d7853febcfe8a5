"""FlashInfer's ragged/paged choice: one pure function, called with the same inputs at
capture, replay and eager, stored in the metadata that both the planner and the forward read.

An upstream engine reverted a unified capture/replay for exactly this: its planner decided
with ``not use_paged`` while the forward had ``use_ragged=True`` hard-coded, so the kernels that
ran were not the ones planned. Here there is one decision and one place that stores it.
"""

from __future__ import annotations

from enum import Enum

from dp_runtime.forward_mode import ForwardMode

__all__ = ["KVLayout", "choose_kv_layout"]


class KVLayout(Enum):
    """How attention reads K/V.

    PAGED: from the paged cache only, after this step's K/V were written to it (decode, and
    extend when determinism is asked for).
    RAGGED: extend only: the new tokens attend to each other from this step's own K/V (a
    ragged batch, causal) and to their cached prefix from the paged cache (non-causal); the two
    partial results are merged by their log-sum-exp.
    """

    PAGED = "paged"
    RAGGED = "ragged"


def choose_kv_layout(forward_mode: ForwardMode, *, deterministic: bool) -> KVLayout:
    """The layout for ``forward_mode``.

    Decode and IDLE always read the paged cache. Extend goes ragged (no gather of the new
    tokens' K/V back from the cache) unless ``deterministic``: the ragged+paged merge reduces in
    an order that depends on how much of each request was cached, so a deterministic run keeps
    one paged pass.
    """
    if forward_mode is ForwardMode.EXTEND and not deterministic:
        return KVLayout.RAGGED
    return KVLayout.PAGED
