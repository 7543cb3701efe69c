"""How long the compiled paged step's first compile of a bucket takes, with Inductor's cache empty, per wrapper.

    OMP_WAIT_POLICY=PASSIVE python scripts/compile_time.py --wrappers python cpp --rows 1 16

For each ``--wrappers`` entry, a child process of its own (so no graph, import or cache is shared) with
``TORCHINDUCTOR_CACHE_DIR`` set to a new empty directory builds a
:class:`~kvslim.cache.paged_compiled.CompiledStep` of the embedded model (float32, ``--threads`` threads) and times
the first decode step of each ``--rows`` count on int4 pages (the compile and that step's run), then runs the same
again in a second child with the directory as the first left it (``cached``: what a later process pays). Prints a
table of seconds. Measure alone: a compile is two cores' work for a minute or more.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def _child(wrapper: str, rows: list[int], threads: int) -> None:
    import torch

    torch.set_num_threads(threads)
    import kvslim
    from kvslim.cache.paged_adapter import forward_pages
    from kvslim.cache.paged_compiled import CompiledStep
    from kvslim.cache.pagepool import pool_for
    from kvslim.models.load import load_model

    model = kvslim.enable(load_model(None, dtype="float32")[0])
    step = CompiledStep(model, wrapper=wrapper)
    out = {}
    with torch.inference_mode():
        pool = pool_for(model, "int4", pages=4 * max(rows) + 8, max_rows=max(rows) + 1)
        for n in rows:
            live = [pool.new_row() for _ in range(n)]
            for r in live:
                forward_pages(model, pool, [([1, 2, 3], r)])
            t = time.perf_counter()
            forward_pages(model, pool, [([5], r) for r in live], row_multiple=1, compiled=step)
            out[n] = time.perf_counter() - t
            for r in live:
                pool.free(r)
    print(json.dumps(out))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--wrappers", nargs="+", default=["python", "cpp"], choices=["python", "cpp"])
    p.add_argument("--rows", nargs="+", type=int, default=[1, 16])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--child", help=argparse.SUPPRESS)
    a = p.parse_args()
    if min(a.rows) < 1 or a.threads < 1:
        p.error("--rows and --threads must be positive")
    if a.child:
        _child(a.child, a.rows, a.threads)
        return
    print(f"first step of each row count (seconds: the compile and the step), {a.threads} threads; load "
          f"{os.getloadavg()[0]:.2f}")  # fmt: skip
    print(f"{'wrapper':8s} {'cache':7s} " + " ".join(f"{f'{n} rows':>9s}" for n in a.rows))
    for wrapper in a.wrappers:
        with tempfile.TemporaryDirectory(prefix="kvslim-inductor-") as d:
            for cache in ("empty", "cached"):
                argv = [sys.executable, __file__, "--child", wrapper, "--threads", str(a.threads), "--rows",
                        *map(str, a.rows)]  # fmt: skip
                done = subprocess.run(argv, env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": d}, capture_output=True,
                                      text=True, check=False)  # fmt: skip
                if done.returncode != 0:
                    sys.exit(f"{wrapper}: the child failed: {done.stderr.strip().splitlines()[-1:]}")
                took = json.loads(done.stdout.strip().splitlines()[-1])
                print(f"{wrapper:8s} {cache:7s} " + " ".join(f"{took[str(n)]:9.1f}" for n in a.rows))
    print(f"load {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
