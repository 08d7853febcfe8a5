"""Errors a launcher raises for a job that no restart can help.

``SetupError`` subclasses ValueError on purpose: callers that map user errors to exit code 2
(``except ValueError``) map it too, and it says the job's inputs (options, model, spec) are
what must change, not the cluster.
"""

from __future__ import annotations

__all__ = ["SetupError", "is_deterministic_setup_error"]


class SetupError(ValueError):
    """A rank could not be built, for a reason a new gang would meet again: a ValueError or an
    ImportError raised while building its worker (e.g. ``num_experts < ep_size``, flashinfer
    missing on the node), or ranks that disagree on their spec. Never retried. ``rank`` is the rank
    that reported it; ``detail`` its remote traceback (for ``--debug``)."""

    def __init__(self, message: str, rank: int | None = None, detail: str = "") -> None:
        super().__init__(message)
        self.rank = rank
        self.detail = detail


def is_deterministic_setup_error(exc: BaseException) -> bool:
    """Whether ``exc`` (raised while building a rank, possibly wrapped by Ray) would happen again
    on a new gang: a ValueError, an ImportError (a package the node lacks, e.g. flashinfer: a
    new gang lands on the same nodes), or a DP mismatch between ranks' configs or specs."""
    from dp_runtime.sync.errors import DPPlanMismatchError

    cause = getattr(exc, "cause", None)  # ray.exceptions.RayTaskError keeps the remote exception
    for e in (exc, cause):
        if (isinstance(e, (ValueError, ImportError, DPPlanMismatchError))
                and not _is_ray_wrapper_only(e)):
            return True
    return False


def _is_ray_wrapper_only(exc: BaseException) -> bool:
    # A RayTaskError(ValueError) is both; judge it by its cause, which the loop also checks.
    return type(exc).__name__.startswith("RayTaskError")
