"""The engine's many-row decode step, timed alone: one JSON line with the step's median, min and max.

    python scripts/step_time.py --rows 16 --length 4096 --config int4 --steps 8 [--linears mkl]

Prefills one cache of ``--config`` with ``--length`` seeded random tokens of the embedded model, copies it into
``--rows`` rows (as ``kvslim bench --concurrency`` does), runs 3 untimed engine decode steps
(:func:`kvslim.generate.forward_rows`) and ``--steps`` timed ones, the linear layers on ``--linears``'s route
(:mod:`kvslim.engine.linears`). The line records the OpenMP variables in force (``OMP_WAIT_POLICY``,
``GOMP_SPINCOUNT``) and the load average before and after, so that runs of one variable each (a wait policy, a
route, a build) can be compared: ``scripts/spin_policy.sh`` runs it under each spin policy, quiet and beside
competing processes. Measure on a quiet machine (``uptime``), alone, unless the load is the point.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--config", default="int4")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--linears", default="torch", help="the route of the linear layers (kvslim.engine.linears)")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    load_before = os.getloadavg()

    import kvslim
    from kvslim.engine.linears import Linears, step_rows
    from kvslim.generate import forward_rows, prefill
    from kvslim.models.load import load_model

    model = load_model(None)[0]
    kvslim.enable(model)
    route = Linears(model, a.linears, batch_hint=step_rows(a.rows))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (1, a.length), generator=g)
    base = kvslim.SlimCache.from_config(kvslim.parse_spec(a.config), config=model.config)
    with torch.inference_mode():
        prefill(model, ids, base, chunk_size=1024)
        rows = [copy.deepcopy(base) for _ in range(a.rows)]
        feed = torch.randint(0, model.config.vocab_size, (a.steps + 3, a.rows), generator=g)
        ms = []
        for r in range(a.steps + 3):
            t = time.perf_counter()
            with route.routed():
                forward_rows(model, feed[r].tolist(), rows).argmax(-1).tolist()
            if r >= 3:
                ms.append((time.perf_counter() - t) * 1e3)
    print(json.dumps({
        "rows": a.rows, "length": a.length, "config": a.config, "linears": a.linears, "threads": a.threads,
        "env": {k: os.environ.get(k) for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")},
        "median_ms": round(statistics.median(ms), 1), "min_ms": round(min(ms), 1), "max_ms": round(max(ms), 1),
        "load_average": [round(x, 2) for x in load_before], "load_average_after": [round(x, 2) for x in os.getloadavg()],
    }))


if __name__ == "__main__":
    main()
