"""Runs the CLI's ``main(argv)`` for several argument lists in one fresh interpreter: each
case's exit code and stderr, and whether torch or ray was ever imported (what a check that
must refuse before anything slow starts is judged by)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.support.pythonpath import checkout_first

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1",
       "PYTHONPATH": checkout_first(REPO)}

_PROBE = """
import contextlib, io, json, sys
from launch.cli import main
out = []
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            main(argv)
            code = 0
        except SystemExit as e:
            code = e.code
    out.append([code, err.getvalue()])
print(json.dumps({"cases": out, "torch": "torch" in sys.modules, "ray": "ray" in sys.modules}))
"""


def probe_cli(cases: list[list[str]], timeout_s: float = 300) -> dict:
    """``{"cases": [[exit code, stderr], ...], "torch": bool, "ray": bool}`` for ``cases``."""
    done = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(cases)], cwd=REPO, env=ENV,
                          capture_output=True, text=True, timeout=timeout_s)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
