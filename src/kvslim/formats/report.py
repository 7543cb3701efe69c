"""Storage cost and reconstruction error of every registered format on N(0, 1) data.

``python -m kvslim.formats.report`` prints the table; :func:`format_error_table` returns its rows.
Each format is measured in both roles: as K (its ``role="k"`` codec, e.g. KIVI per-channel with
token groups) and as V (``role="v"``, e.g. KIVI per-token).
"""

from __future__ import annotations

import argparse

import torch

from .base import format_names, make_codec


def format_error_table(
    shape: tuple[int, int, int, int] = (1, 3, 4096, 64),
    group_size: int = 32,
    v_group_size: int | None = None,
    seed: int = 0,
    device: str | torch.device = "cpu",
) -> list[dict]:
    """Rows ``{format, role, bits_per_element, max_abs_err, rmse}`` for every registered format.

    The data is ``N(0, 1)`` fp32 of ``shape`` ``(B, H, T, D)`` drawn from ``seed``; errors are of
    ``decode(encode(x))`` in fp32 against ``x``, computed in float64.
    """
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen, dtype=torch.float32).to(device)  # (B, H, T, D)
    head_dim = shape[-1]
    rows = []
    for name in format_names():
        for role in ("k", "v"):
            codec = make_codec(name, role, group_size=group_size, v_group_size=v_group_size)
            codec.check_head_dim(head_dim)
            y = codec.decode(codec.encode(x), torch.float32)
            err = (y.double() - x.double()).abs()
            rows.append(
                {
                    "format": name,
                    "role": role,
                    "bits_per_element": codec.bits_per_element(head_dim),
                    "max_abs_err": float(err.max()),
                    "rmse": float(err.square().mean().sqrt()),
                }
            )
    return rows


def _render(rows: list[dict]) -> str:
    headers = ["format", "role", "bits/elem", "max abs err", "rmse"]
    cells = [
        [
            r["format"],
            r["role"],
            f"{r['bits_per_element']:.3f}",
            f"{r['max_abs_err']:.4g}",
            f"{r['rmse']:.4g}",
        ]
        for r in rows
    ]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvslim.formats.report", description=__doc__.splitlines()[0])
    p.add_argument("--shape", type=int, nargs=4, default=[1, 3, 4096, 64], metavar=("B", "H", "T", "D"))
    p.add_argument("--group-size", type=int, default=32, help="K token group of the affine formats")
    p.add_argument("--v-group-size", type=int, default=None, help="V channel group (default: head_dim)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    args = p.parse_args(argv)
    rows = format_error_table(tuple(args.shape), args.group_size, args.v_group_size, args.seed, args.device)
    print(f"N(0, 1) data of shape {tuple(args.shape)}, K group {args.group_size}, seed {args.seed}")
    print(_render(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
