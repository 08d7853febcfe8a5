"""Run one benchmark in several source trees, one after the other in the same call on the same
machine, and print the rows side by side with ratios: the way a speed change is judged here
(the commit before it, against it, in one run).

    python bench/compare_trees.py --base .baseline -- python bench/serve_step.py --layers 8
    python bench/compare_trees.py --base .b1 --base .b2 --nproc 2 -- bench/serve_step.py

Each ``--base`` is a checkout of an earlier commit (``git worktree add`` or ``git archive``),
oldest first; the command runs with each tree first on ``PYTHONPATH`` and its script paths
rewritten into it, then with this tree. Each column's ratio is against the column before it. The benchmark must print one JSON document as its last line with ``rows``
(dicts) and a time column (``--metric``, default ``step_ms``); rows are matched on ``--key``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]


def run(tree: Path, cmd: list[str], nproc: int) -> dict:
    args = [str(tree / a) if a.endswith(".py") and (tree / a).exists() else a for a in cmd]
    if nproc > 1:
        args = ["torchrun", "--standalone", f"--nproc-per-node={nproc}", *args]
    env = dict(os.environ, PYTHONPATH=f"{tree}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    env.pop("BENCH_COMMIT", None)
    # A lent machine has no .git: the tree's name (or BENCH_COMMIT for this one) labels it.
    env["BENCH_COMMIT"] = os.environ.get("BENCH_COMMIT", "HEAD") if tree == HERE else tree.name
    print(f"== {tree}: {' '.join(args)}", flush=True)
    out = subprocess.run([*args, "--json"], cwd=tree, env=env, capture_output=True, text=True, check=False)
    sys.stderr.write(out.stderr[-4000:])
    if out.returncode != 0:
        raise SystemExit(f"{tree}: the benchmark failed (exit {out.returncode})")
    last = [line for line in out.stdout.splitlines() if line.startswith("{")][-1]
    return json.loads(last)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", required=True, type=Path, action="append", help="an earlier commit's tree")
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--key", default="bs,mode")
    p.add_argument("--metric", default="step_ms", help="time column(s), comma-separated: one table each")
    p.add_argument("--json-out", type=Path)
    p.add_argument("cmd", nargs=argparse.REMAINDER)
    a = p.parse_args()
    cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd
    cmd = cmd[1:] if a.nproc > 1 and cmd[:1] == ["python"] else cmd
    trees = [b.resolve() for b in a.base] + [HERE]
    docs = [run(t, cmd, a.nproc) for t in trees]
    keys = a.key.split(",")
    print()
    for t, doc in zip(trees, docs, strict=True):
        head = doc["header"]  # a line of text, or a dict (prefill.py, serve_load.py)
        head = head.splitlines()[0] if isinstance(head, str) else ", ".join(f"{k} {v}" for k, v in head.items())
        print(f"{t.name or 'this tree'}: {head}")
    names = [t.name for t in trees]
    by_tree = [{tuple(r[k] for k in keys): r for r in doc["rows"]} for doc in docs]
    table = []
    for metric in a.metric.split(","):
        print(f"{metric}:")
        print(" ".join(f"{k:>6}" for k in keys) + "".join(f" {n[:14]:>14} {'ratio':>6}" for n in names))
        for key in by_tree[-1]:
            if not all(key in rows for rows in by_tree):
                continue
            vals = [rows[key][metric] for rows in by_tree]
            cells = "".join(f" {v:>14.3f} {'' if i == 0 else f'{v / vals[i - 1]:.3f}':>6}" for i, v in enumerate(vals))
            print(" ".join(f"{v!s:>6}" for v in key) + cells)
            table.append(dict(zip(keys, key, strict=True), metric=metric, values=vals))
    for name, doc in zip(names, docs, strict=True):
        census = doc.get("census") or []
        for c in [census] if isinstance(census, dict) else census:  # one dict in older trees
            print(f"{name} census at bs {c['bs']}: {c['per_layer']:.1f} GPU activities/layer, GPU busy {c['gpu_busy_us'] / 1e3:.2f} ms,"
                  f" host {c['host_us'] / 1e3:.2f} ms ({100 * c['host_us'] / max(c['gpu_busy_us'], 1):.0f}% of GPU)")
            for kname, n, us in c["top"][:8]:
                print(f"    {n:>5} {us:>9.1f} us  {kname}")
    if a.json_out:
        a.json_out.write_text(json.dumps(dict(trees=names, docs=docs, table=table), indent=1))


if __name__ == "__main__":
    main()
