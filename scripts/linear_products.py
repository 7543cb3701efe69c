"""One pass over the embedded model's weight products (every routable ``nn.Linear``, each weight streamed from memory
as in a step) at several row counts through each route for the linear layers: what ``auto`` times at start-up
(:func:`kvslim.engine.linears.products_ms`, the fastest of its interleaved passes), at every row count asked.

    python scripts/linear_products.py --rows 1 4 16 64 256 1024 --routes torch onednn kvslim
    python scripts/linear_products.py --dtype bfloat16 --rows 1 16 64 --routes torch kvslim

Milliseconds a pass, and each route's speed against torch's. Measure on a quiet machine (``uptime`` before and
after), alone, under the wait policy the server runs with (the CLI's default: ``OMP_WAIT_POLICY=PASSIVE``).
"""

from __future__ import annotations

import argparse

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64, 256, 1024])
    p.add_argument("--routes", nargs="+", default=["torch", "onednn", "kvslim"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="the model's weights")
    a = p.parse_args()
    torch.set_num_threads(a.threads)

    from kvslim.engine.linears import _routable, products_ms
    from kvslim.models.load import load_model

    model = load_model(None, dtype=a.dtype)[0]
    modules = [m for m in model.modules() if _routable(m, (getattr(torch, a.dtype),))]
    print(f"{len(modules)} {a.dtype} products a pass, {a.threads} threads; ms a pass (fastest of the interleaved passes)")
    print(f"{'rows':>6s} " + " ".join(f"{r:>9s}" for r in a.routes) + "  " + " ".join(f"{r + '/torch':>13s}" for r in a.routes if r != "torch"))
    for n in a.rows:
        ms = products_ms(modules, n, tuple(a.routes), exact=True)
        ratios = " ".join(f"{ms['torch'] / ms[r]:12.2f}x" for r in a.routes if r != "torch") if "torch" in ms else ""
        print(f"{n:6d} " + " ".join(f"{ms[r]:9.1f}" for r in a.routes) + "  " + ratios)


if __name__ == "__main__":
    main()
