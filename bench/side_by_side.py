"""The rows of several benchmark runs of one call side by side, each column's ratio against the
first: DP 2 runs against the DP 1 run beside them (``bench/run_gpu.sh dp2a``, ``dp2b``).

    python bench/side_by_side.py --key bs,mode --metric tok_s_per_gpu,step_ms dp1=a.log dp2=b.log
    python bench/side_by_side.py --key rate --metric output_tok_s/gpu,efficiency,itl_s.p99 \\
        dp1=load1.log dp2=load2.log

Each ``LABEL=FILE`` is the output of a benchmark run with ``--json`` (serve_step.py, serve_load.py,
serve_http.py): its last line that starts with ``{`` is the JSON document (``header`` and
``rows``), so a step log of ``run_gpu.sh`` (stdout and stderr together) serves. A file that is
missing or holds no document is named and left out. Rows are matched on ``--key`` (a rate of
``null`` is ``inf``); ``--where FIELD=VALUE`` keeps the rows whose FIELD has that value (rows
without the field stay). A metric is a row field, dotted for a nested one (``itl_s.p99``);
``/gpu`` divides it by the run's GPUs: the header's ``world_size`` or ``dp``, or ``xN`` in a text
header (serve_step's). Fields in seconds (``*_s``) print in ms, fractions (``efficiency``,
``occupancy``, ``ideal_occupancy``, ``dp_balance``) in %. ``--tables``: serve_load's own table of
each document too (``load_table.print_table``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

FRACTIONS = ("efficiency", "occupancy", "ideal_occupancy", "dp_balance")


def load_doc(path: Path) -> dict[str, Any] | None:
    """The last JSON document of ``path`` (module docstring), or None."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        if line.startswith("{"):
            try:
                doc = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(doc, dict) and "rows" in doc:
                return doc
    return None


def gpus(doc: dict[str, Any]) -> int:
    """The GPUs (ranks) of a run: header world_size or dp, or `` xN`` in a text header; 1 if none."""
    head = doc.get("header")
    if isinstance(head, dict):
        return int(head.get("world_size") or head.get("dp") or 1)
    found = re.search(r" x(\d+)\b", head or "")
    return int(found.group(1)) if found else 1


def value(row: dict[str, Any], metric: str, ranks: int) -> float | None:
    """``metric`` of ``row`` (module docstring: dotted path, ``/gpu``); None where absent."""
    path, per_gpu = (metric[:-4], True) if metric.endswith("/gpu") else (metric, False)
    v: Any = row
    for part in path.split("."):
        v = v.get(part) if isinstance(v, dict) else None
    if not isinstance(v, int | float) or isinstance(v, bool):
        return None
    return v / ranks if per_gpu else float(v)


def unit(metric: str) -> tuple[str, float]:
    """(label suffix, scale) for printing ``metric``."""
    head = metric.split(".")[0].removesuffix("/gpu")
    if head.endswith("_s") and not head.endswith("tok_s"):
        return " (ms)", 1e3
    if head in FRACTIONS:
        return " (%)", 100.0
    return "", 1.0


def key_text(v: Any, field: str) -> str:
    if field == "rate" and v is None:
        return "inf"
    return f"{v:g}" if isinstance(v, float) else str(v)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--key", default="bs,mode", help="row fields that match rows across runs")
    p.add_argument("--metric", default="tok_s_per_gpu", help="comma-separated (module docstring)")
    p.add_argument("--where", action="append", default=[], help="FIELD=VALUE: keep rows with that value")
    p.add_argument("--title", default="")
    p.add_argument("--tables", action="store_true", help="serve_load's table of each document too")
    p.add_argument("runs", nargs="+", help="LABEL=FILE, the first the baseline")
    a = p.parse_args(argv)
    keys = a.key.split(",")
    where = [w.split("=", 1) for w in a.where]
    docs: list[tuple[str, dict[str, Any]]] = []
    for run in a.runs:
        label, _, file = run.partition("=")
        doc = load_doc(Path(file)) if file else None
        if doc is None:
            print(f"{label}: no JSON document in {file or '(no file named)'}: left out")
        else:
            docs.append((label, doc))
    if not docs:
        return 1
    if a.title:
        print(a.title)
    for label, doc in docs:
        head = doc["header"]  # serve_step's: text, its first line and the model's (with the dispatcher)
        head = "; ".join(x for i, x in enumerate(head.splitlines()) if i == 0 or x.startswith("model")) \
            if isinstance(head, str) else ", ".join(
            f"{k} {v}" for k, v in head.items() if k in ("commit", "device", "world_size", "dp", "launcher", "dispatcher",
                                                         "max_running_requests", "num_requests", "policies", "policy"))
        print(f"  {label}: {gpus(doc)} GPU(s); {head}")
        if a.tables and isinstance(doc["header"], dict) and "world_size" in doc["header"]:
            from bench.load_table import print_table

            print_table(doc)

    def keep(row: dict[str, Any]) -> bool:
        return all(field not in row or str(row[field]) == want for field, want in where)

    by_run = [{tuple(r.get(k) for k in keys): r for r in doc["rows"] if keep(r)} for _, doc in docs]
    order = list(dict.fromkeys(k for rows in by_run for k in rows))
    for metric in a.metric.split(","):
        suffix, scale = unit(metric)
        print(f"{metric}{suffix}, ratio against {docs[0][0]}:")
        print(" ".join(f"{k:>6}" for k in keys) + "".join(f" {label[:12]:>12} {'ratio':>6}" for label, _ in docs))
        for key in order:
            vals = [value(rows[key], metric, gpus(doc)) if key in rows else None
                    for rows, (_, doc) in zip(by_run, docs, strict=True)]
            base = vals[0]
            cells = "".join(
                f" {'-' if v is None else f'{v * scale:.2f}':>12} "
                f"{'' if i == 0 or v is None or not base else f'{v / base:.3f}':>6}" for i, v in enumerate(vals))
            print(" ".join(f"{key_text(v, k):>6}" for k, v in zip(keys, key, strict=True)) + cells)
    return 0


if __name__ == "__main__":
    sys.exit(main())
