"""The `dp-runtime` command line: tables for people, --json for programs."""

from __future__ import annotations

import typer

from dp_runtime.version import __version__
from launch import cli_bench, cli_plan, cli_run

app = typer.Typer(add_completion=False, no_args_is_help=True, help="dp-runtime: DP attention + EP MoE runtime.")


def _version(value: bool) -> None:
    if value:
        typer.echo(f"dp-runtime {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version and exit."),
) -> None:
    """Data-parallel attention and expert-parallel MoE runtime."""


app.command("run")(cli_run.run)
app.command("bench")(cli_bench.bench)
app.command("plan")(cli_plan.plan)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
