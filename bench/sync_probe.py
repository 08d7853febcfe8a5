"""Where a serving run makes the host wait for the GPU: ``bench/serve_load.py`` in this process
under torch's CUDA sync debug mode, with the allocator's device calls counted.

    python bench/sync_probe.py -- --model qwen3-30b-a3b --device cuda --rates inf ...

Everything after ``--`` is serve_load's. Prints, after serve_load's own output:

- each place in this repository's code where torch warned of a synchronizing call (``.item()``,
  a pageable copy, ``nonzero``, ...), with how often; the build's warnings count too, so a
  place whose count grows with the run's steps is the one to read;
- the caching allocator's ``num_device_alloc`` / ``num_device_free`` (cudaMalloc / cudaFree:
  a cudaFree waits for the whole device) and ``num_alloc_retries`` (a failed cudaMalloc that
  freed cached blocks and tried again), over the whole process.

A diagnostic, not a measurement: the debug mode's checks slow the host.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import collections
import traceback
import warnings

import torch

from bench import serve_load

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> int:
    argv = sys.argv[1:]
    if argv[:1] == ["--"]:
        argv = argv[1:]
    places: collections.Counter[str] = collections.Counter()
    shown = warnings.showwarning

    def count(message, category, filename, lineno, file=None, line=None):
        if "Synchroniz" not in str(message) and "synchroniz" not in str(message):
            return shown(message, category, filename, lineno, file, line)
        frames = [f for f in traceback.extract_stack()[:-1] if f.filename.startswith(_REPO)
                  and "sync_probe" not in f.filename]
        where = " <- ".join(f"{os.path.relpath(f.filename, _REPO)}:{f.lineno}" for f in frames[-3:][::-1])
        places[f"{str(message).splitlines()[0][:60]} at {where or filename + ':' + str(lineno)}"] += 1

    warnings.showwarning = count
    warnings.simplefilter("always")
    cuda = torch.cuda.is_available()  # a CPU run (a dry run of the mode) counts nothing
    if cuda:
        torch.cuda.set_sync_debug_mode("warn")
    try:
        rc = serve_load.main(argv)
    finally:
        if cuda:
            torch.cuda.set_sync_debug_mode("default")
    stats = torch.cuda.memory_stats() if cuda else {}
    print("sync_probe: synchronizing calls by place (count, place):")
    for place, n in places.most_common(25):
        print(f"  {n:>7}  {place}")
    print("sync_probe: allocator: " + ", ".join(
        f"{k} {stats.get(k, 0)}" for k in ("num_device_alloc", "num_device_free", "num_alloc_retries",
                                           "num_sync_all_streams")))
    return rc


if __name__ == "__main__":
    sys.exit(main())
