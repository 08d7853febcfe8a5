"""One line per rate of a bench/serve_load.py JSON report in a step log (read as
``side_by_side.load_doc`` reads it):
out tok/s, its efficiency, TPOT/ITL/TTFT percentiles, the steps by kind and, with
``--gpu-spans``, the gap between steps and the GPU's busy share. For a call's summary.

    python bench/load_rows.py LOG [LOG ...]
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.side_by_side import load_doc


def rows(path: str) -> list[str]:
    report = load_doc(Path(path))
    out = []
    for r in [] if report is None else report["rows"]:
        gpu = r.get("gpu") or {}
        spans = f" gap p50 {gpu['gap_p50_ms']:.3f} ms busy {gpu['busy']:.3f}" if gpu else ""
        ms = {k: r[k] for k in ("tpot_s", "itl_s", "ttft_s")}
        out.append(
            f"{path.rsplit('/', 1)[-1]} rate {r['rate'] or 'inf'}: {r['output_tok_s']:.1f} out tok/s, "
            f"eff {r['efficiency']:.3f}, TPOT p50 {ms['tpot_s']['p50'] * 1e3:.2f}, ITL p50/p99 "
            f"{ms['itl_s']['p50'] * 1e3:.2f}/{ms['itl_s']['p99'] * 1e3:.2f}, TTFT p50/p99 "
            f"{ms['ttft_s']['p50'] * 1e3:.1f}/{ms['ttft_s']['p99'] * 1e3:.1f} ms, steps {r['steps']}, "
            f"errors {r['errors']}{spans}")
    return out


def main(argv: list[str]) -> int:
    for path in argv:
        for line in rows(path):
            print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
