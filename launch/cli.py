"""The `dp-runtime` command line: tables for people, --json for programs.

``main()`` runs the app and turns what went wrong into an exit code (``cli_errors``): a
command-line parse error (unknown option, a value of the wrong type) is one line on stderr and
exit 2, like every other user error; Ctrl-C is 130. The command modules import torch, Ray and
the runtime only inside their commands, so ``--help`` and ``--version`` answer at once.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import typer

from dp_runtime.version import __version__
from launch import cli_bench, cli_plan, cli_run, cli_serve
from launch.cli_errors import EXIT_INTERRUPTED, EXIT_USAGE

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  rich_markup_mode=None, help="dp-runtime: DP attention + EP MoE runtime.")


def _version(value: bool) -> None:
    if value:
        typer.echo(f"dp-runtime {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                 help="Print the version and exit."),
) -> None:
    """Data-parallel attention and expert-parallel MoE runtime."""


app.command("run")(cli_run.run)
app.command("bench")(cli_bench.bench)
app.command("plan")(cli_plan.plan)
app.command("serve")(cli_serve.serve)


def main(argv: Sequence[str] | None = None) -> None:
    """Run the CLI on ``argv`` (default: the process's arguments) and exit with its code."""
    # click's UsageError, wherever this typer takes click from (it may vendor its own copy).
    usage_error = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "UsageError")
    try:
        code = app(args=list(argv) if argv is not None else None, prog_name="dp-runtime",
                   standalone_mode=False)
    except usage_error as e:
        message = e.format_message()
        if message:  # empty when no arguments printed the help instead
            hint = f" (see '{e.ctx.command_path} --help')" if e.ctx is not None else ""
            print(f"error: {message}{hint}", file=sys.stderr, flush=True)
        code = EXIT_USAGE
    except typer.Abort:  # Ctrl-C outside a command (click turns it into Abort)
        print("interrupted", file=sys.stderr, flush=True)
        code = EXIT_INTERRUPTED
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
