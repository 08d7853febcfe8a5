"""One temporary directory for a multi-rank test job: made by rank 0, its path broadcast to
every rank, removed by rank 0 after every rank is done with it.

Not pytest's tmp_path_factory: ranks share pytest's numbered base directory, and one rank's
cleanup can remove another's files."""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch.distributed as dist

__all__ = ["job_dir"]


@contextlib.contextmanager
def job_dir(prefix: str) -> Iterator[Path]:
    """The job's directory on every rank (a collective: every rank enters and leaves it)."""
    tmp = tempfile.TemporaryDirectory(prefix=prefix) if dist.get_rank() == 0 else None
    name = [tmp.name if tmp is not None else None]
    dist.broadcast_object_list(name, src=0)
    try:
        yield Path(name[0])
    finally:
        dist.barrier()
        if tmp is not None:
            tmp.cleanup()
