"""How the command line ends: exit codes, the user-error type, and the one-line error report.

Exit codes (``dp-runtime run``, ``dp-runtime plan``, the torchrun entry):

- 0: done;
- 1: the run failed (the gang failed after every allowed restart), or a bug (with traceback);
- 2: a user error: a bad option, workload, model or config, or a cluster that cannot hold the
  ranks asked for; one line on stderr, no traceback unless ``--debug``;
- 3: the run finished but some requests failed on their own (refused at the door: over the
  context, a bad token id; or failed inside a step); each is listed with its reason
  (``dp-runtime run`` only);
- 130: interrupted (Ctrl-C), after everything this command started was stopped;
- 143: terminated (SIGTERM; 128 + 15, as a shell reports it), the same way (``dp-runtime run``;
  ``serve`` exits 0 on SIGTERM: a server asked to stop has done its job).

This module imports nothing heavy: ``--help`` and ``--version`` must not pay for torch.
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Sequence

__all__ = ["EXIT_FAILED", "EXIT_INTERRUPTED", "EXIT_OK", "EXIT_REQUESTS_FAILED", "EXIT_TERMINATED",
           "EXIT_USAGE", "LOG_LEVELS", "UsageError", "bench_main", "check_choice", "error_line",
           "is_user_error"]

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_REQUESTS_FAILED, EXIT_INTERRUPTED = 0, 1, 2, 3, 130
EXIT_TERMINATED = 143
LOG_LEVELS = ("debug", "info", "warning", "error")


class UsageError(ValueError):
    """A command-line option or input the run cannot use; the message names the option as the
    user typed it (``--hang-timeout``), the rule and the value."""


def check_choice(option: str, value: str, choices: Sequence[str]) -> None:
    """Raise UsageError unless ``value`` is one of ``choices`` (``option`` as typed, e.g.
    ``--device``)."""
    if value not in choices:
        raise UsageError(f"{option} must be one of {', '.join(choices)}; got {value!r}")


def is_user_error(exc: BaseException) -> bool:
    """Errors that bad input causes: ValueError (UsageError, WorkloadError, the runtime's config,
    spec and model-config errors all derive from it) and a missing or unreadable file."""
    return isinstance(exc, (ValueError, OSError))


def error_line(exc: BaseException) -> str:
    """The exception as one line: its message with newlines folded (a multi-line message, e.g. a
    rank's traceback, keeps its last line)."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    if not lines:
        return type(exc).__name__
    return lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}"


def print_error(exc: BaseException, *, debug: bool = False) -> None:
    """``error: <one line>`` on stderr; with ``debug`` the traceback first."""
    if debug:
        traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
    print(f"error: {error_line(exc)}", file=sys.stderr, flush=True)


def bench_main(argv, parse_args, run, print_table) -> int:
    """The ``main`` of a benchmark script: parse, run, print a table (or the report as one JSON
    line with ``--json``). A user error (bad options, a model that cannot hold them, a missing
    checkpoint) is one ``error:`` line and exit 2; ``--debug`` keeps the traceback."""
    import json

    debug = "--debug" in (sys.argv[1:] if argv is None else argv)
    try:
        args = parse_args(argv)
        report = run(args)
    except (UsageError, ValueError, OSError) as e:
        if debug and not isinstance(e, UsageError):
            raise
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    if report is not None:
        if args.json:
            print(json.dumps(report), flush=True)
        else:
            print_table(report)
    return 0
