"""The README's code blocks, as written (README.md, "Test tiers").

Each fenced block is meant to run unless the line before it is a marker:
``<!-- readme-test: run by tests/FILE.py -->`` (that test reads the block from README.md and runs
it) or ``<!-- readme-test: not run: WHY -->``. Of the blocks meant to run: every command line of a
``bash`` block is checked by what it runs: ``dp-runtime`` / ``python -m launch`` by the command's
own click parser (an unknown option or a value of the wrong type fails), the torchrun entry by its
argparse parser and torchrun's own ``--help``, ``pip install`` by the extras pyproject.toml has and
the torch version installed, ``bash FILE`` by the file; the Serve section's ``curl`` lines and
every ``python`` block run against a real server (local launcher, a tiny checkpoint with a trained
tokenizer, in a directory named ``checkpoint`` as the examples call the model), the port aside.
A command nothing here knows how to check fails the test: mark its block, or teach this file.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.serve_process import ServeProcess

REPO = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
MARKER = re.compile(r"<!-- readme-test: (run by (\S+)|not run: .+?) -->\s*$")
CHECKED = ("dp-runtime", "python -m launch", "torchrun", "pip install", "bash", "curl")


def _blocks() -> list[tuple[str, str, str | None]]:
    """(language, text, marker) of every fenced block of README.md."""
    text = (REPO / "README.md").read_text()
    out = []
    for m in FENCE.finditer(text):
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        marker = MARKER.search(before)
        out.append((m.group(1), m.group(2), marker.group(1) if marker else None))
    return out


def _commands(block: str) -> list[list[str]]:
    """The block's command lines (continuations joined, comments dropped, ``&&`` split) as
    argument lists."""
    joined = block.replace("\\\n", " ")
    commands = []
    for line in joined.splitlines():
        for part in line.split("&&"):
            args = shlex.split(part, comments=True)
            if args:
                commands.append(args)
    return commands


def _runs_now(lang: str, text: str, marker: str | None) -> bool:
    return marker is None and lang in ("bash", "python")


def test_markers_name_tests_that_read_the_readme():
    blocks = _blocks()
    assert len(blocks) >= 8, blocks
    for lang, text, marker in blocks:
        assert lang in ("bash", "python", "json", ""), (lang, text)
        if marker and marker.startswith("run by "):
            path = REPO / marker.removeprefix("run by ")
            assert path.is_file() and "README" in path.read_text(), marker
    for lang, text, _ in blocks:
        if lang == "python":
            compile(text, "README.md", "exec")  # every Python block at least compiles


def _dp_runtime_parse(args: list[str]) -> None:
    """Parse ``dp-runtime ARGS`` with the command's own click parser (no command runs)."""
    import typer

    from launch.cli import app

    group = typer.main.get_command(app)
    args = [a for a in args if a != "..."]  # a placeholder for "the options above"
    with group.make_context("dp-runtime", [args[0]], resilient_parsing=True) as ctx, \
            group.commands[args[0]].make_context(args[0], args[1:], parent=ctx):
        pass


def _check_command(args: list[str]) -> str:
    """Check one command line (module docstring); returns what it was checked as."""
    if args[0] == "dp-runtime":
        _dp_runtime_parse(args[1:])
        return "dp-runtime"
    if args[:3] == ["python", "-m", "launch"]:
        _dp_runtime_parse(args[3:])
        return "python -m launch"
    if args[0] == "torchrun":
        from launch.torchrun_main import _parser

        i = args.index("-m")
        assert args[i + 1] == "launch.torchrun_main", args
        _parser().parse_args(args[i + 2:])
        help_text = subprocess.run(["torchrun", "--help"], capture_output=True, text=True).stdout
        for opt in args[1:i]:
            assert opt.split("=")[0] in help_text, (opt, args)
        return "torchrun"
    if args[:2] == ["pip", "install"]:
        tomllib = pytest.importorskip("tomllib")  # Python 3.11+
        extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
            "optional-dependencies"]
        for arg in args[2:]:
            for m in re.finditer(r"\[([\w,]+)\]", arg):
                assert set(m.group(1).split(",")) <= set(extras), (arg, sorted(extras))
            if arg.startswith("torch=="):
                import torch

                assert torch.__version__.split("+")[0] == arg.removeprefix("torch=="), arg
        return "pip install"
    if args[0] == "bash":
        assert (REPO / args[1]).is_file(), args
        return "bash"
    if args[0] == "curl":
        return "curl"  # run against the server below
    raise AssertionError(f"README command nothing checks: {shlex.join(args)} (mark its block)")


def test_every_command_line_parses_with_the_command_s_own_options():
    seen = set()
    for lang, text, marker in _blocks():
        if lang == "bash" and _runs_now(lang, text, marker):
            for args in _commands(text):
                seen.add(_check_command(args))
    assert {"dp-runtime", "torchrun", "pip install", "curl"} <= seen <= set(CHECKED), seen


def test_a_misspelled_option_would_fail():
    _dp_runtime_parse(["serve", "--model", "tiny", "--launcher", "local"])
    import typer

    # click's UsageError, wherever this typer takes click from (it may vendor its own copy).
    usage_error = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "UsageError")
    with pytest.raises(usage_error, match="No such option: --modle"):
        _dp_runtime_parse(["serve", "--modle", "tiny"])
    with pytest.raises(typer.BadParameter):
        _dp_runtime_parse(["run", "--dp", "two"])


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from tests.support.serve_model import write_serve_checkpoint

    ckpt = write_serve_checkpoint(tmp_path_factory.mktemp("readme") / "checkpoint")
    with ServeProcess(tmp_path_factory.mktemp("logs"), "--model", str(ckpt), "--launcher", "local",
                      "--context-len", "64") as srv:
        yield srv
    assert srv.returncode == 0, srv.log()


def _here(text: str, server) -> str:
    return text.replace("http://127.0.0.1:8000", server.url)


def test_the_serve_section_s_curl_lines_and_python_client_run_against_a_real_server(server):
    ran = 0
    for lang, text, marker in _blocks():
        if not _runs_now(lang, text, marker):
            continue
        if lang == "python":
            done = subprocess.run([sys.executable, "-c", _here(text, server)], capture_output=True,
                                  text=True, timeout=120)
            assert done.returncode == 0 and done.stdout.strip(), done.stderr[-3000:]
            ran += 1
        for args in _commands(text) if lang == "bash" else []:
            if args[0] != "curl":
                continue
            done = subprocess.run(
                [_here(a, server) for a in args], capture_output=True, text=True, timeout=120)
            assert done.returncode == 0, done.stderr
            assert '"error"' not in done.stdout and ("choices" in done.stdout), done.stdout[-2000:]
            if "stream" in " ".join(args):
                assert done.stdout.rstrip().endswith("data: [DONE]"), done.stdout[-500:]
            ran += 1
    assert ran >= 3, ran
