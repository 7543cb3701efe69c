"""Does a row of a matrix product round the same whatever the number of rows? (kvslim.cache.ragged, "Filler rows")

For the embedded model's linear shapes (and the tiny test model's), compares the first 4 rows of
``linear(x[:M], W)`` with ``linear(x[:4], W)`` bit for bit, through torch's ``linear`` (MKL here) and through
oneDNN with the weight as it is and packed (kvslim.engine.linears' ``onednn`` and ``packed`` routes), for M in multiples of 4 up to 4,400 (the packed
step of a 4,096-token chunk beside 16 decode tokens), and rows 1..3 / odd counts for contrast; at 1 and 2
threads. Prints the row counts that differ. The batch engine's bit-identity (a row's logits the same in any
step) rests on "no multiple of 4 differs".

    python scripts/blas_row_invariance.py
"""

from __future__ import annotations

import torch

SHAPES = [(576, 576), (576, 192), (576, 1536), (1536, 576), (576, 49152), (128, 128), (128, 256), (256, 128)]
MULTIPLES = [4, 8, 12, 16, 20, 32, 36, 64, 100, 128, 132, 256, 260, 272, 512, 516, 1024, 1028, 2048, 4096, 4112, 4400]


def main() -> None:
    print(torch.__config__.show().splitlines()[-1][:200])
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for k, n in SHAPES:
            g = torch.Generator().manual_seed(0)
            w = torch.randn(n, k, generator=g) / k**0.5
            x = torch.randn(4400, k, generator=g)
            for route, lin in _routes(w):
                ref = lin(x[:4])
                counts = MULTIPLES if n < 49152 else MULTIPLES[:10]
                bad = [m for m in counts if not torch.equal(lin(x[:m])[:4], ref)]
                odd = [m for m in (1, 2, 3, 5, 7, 9, 13, 17, 33) if not torch.equal(lin(x[:m])[:1], ref[:1])]
                print(f"threads {threads} {route:<6} (in {k}, out {n}): multiples of 4 that differ {bad}; "
                      f"other counts that differ {odd}")


def _routes(w: torch.Tensor):
    """(name, fn) for torch's linear and, where torch has oneDNN, kvslim.engine.linears' two oneDNN routes."""
    yield "torch", lambda x: torch.nn.functional.linear(x, w)
    if torch.backends.mkldnn.is_available():
        run = torch.ops.mkldnn._linear_pointwise
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 16)
        yield "onednn", lambda x: run(x, w, None, "none", [], "")
        yield "packed", lambda x: run(x, packed, None, "none", [], "")


if __name__ == "__main__":
    main()
