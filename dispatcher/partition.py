"""Which EP rank owns which expert: contiguous ranges, the same rule as FlashInfer's kernels.

With ``E`` experts over ``R`` ranks, ``base = E // R`` and ``rem = E % R``: ranks ``[0, rem)`` own
``base + 1`` experts and the others ``base``, in order. When ``R`` divides ``E`` this is rank ``r``
owning ``[r*E/R, (r+1)*E/R)``; the uneven rule is FlashInfer's ``compute_target_rank_id`` so that
all backends agree on ownership.

Legend: ``N`` rows, ``K`` top-k slots per row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["INVALID_EXPERT_ID", "ExpertPartition"]

# Local expert id of a (row, slot) pick that this rank does not serve: another rank's expert, or a
# padded row (FlashInfer's sanitize writes it into received rows past each source's count).
INVALID_EXPERT_ID = -1


@dataclass(frozen=True)
class ExpertPartition:
    """Contiguous partition of ``num_experts`` experts over ``ep_size`` ranks."""

    num_experts: int
    ep_size: int

    def __post_init__(self) -> None:
        if self.ep_size < 1:
            raise ValueError(f"ep_size must be >= 1, got {self.ep_size}")
        if self.num_experts < self.ep_size:
            raise ValueError(
                f"num_experts={self.num_experts} < ep_size={self.ep_size}: every EP rank must own "
                "at least one expert"
            )

    @property
    def _base(self) -> int:
        return self.num_experts // self.ep_size

    @property
    def _rem(self) -> int:
        return self.num_experts % self.ep_size

    def num_local(self, rank: int) -> int:
        """Number of experts rank ``rank`` owns."""
        return self._base + (1 if rank < self._rem else 0)

    def first(self, rank: int) -> int:
        """Global id of rank ``rank``'s first expert."""
        return rank * self._base + min(rank, self._rem)

    def owner_of(self, expert_ids: torch.Tensor) -> torch.Tensor:
        """Owner rank of each global expert id (same shape; ids must be in range)."""
        base, rem = self._base, self._rem
        if rem == 0:
            return torch.div(expert_ids, base, rounding_mode="floor")
        split = rem * (base + 1)
        return torch.where(expert_ids < split,
                           torch.div(expert_ids, base + 1, rounding_mode="floor"),
                           rem + torch.div(expert_ids - split, base, rounding_mode="floor"))

    def local_ids(self, expert_ids_NK: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank-local expert ids (int32): ``id - first(rank)`` where ``rank`` owns ``id``, else
        ``INVALID_EXPERT_ID``. Out-of-range and invalid ids map to ``INVALID_EXPERT_ID`` too."""
        return self.local_ids_of(expert_ids_NK, self.first(rank), self.num_local(rank))

    @staticmethod
    def local_ids_of(expert_ids_NK: torch.Tensor, first: int, num_local: int) -> torch.Tensor:
        """``local_ids`` for the rank whose experts are ``[first, first + num_local)``."""
        local = expert_ids_NK.to(torch.int32) - first
        owned = (local >= 0) & (local < num_local)
        return local.masked_fill(~owned, INVALID_EXPERT_ID)
