"""``kvslim bench --concurrency --peers --peer-rounds N``: kvslim's rows and the serving peers' measured in turn, N
times, so that a ratio between them is not one host phase against another.

A peer runs in a process of its own (:mod:`.concurrency_peers`), so its steps cannot be interleaved with kvslim's
round by round as kvslim's modes are with each other (:mod:`.concurrency`). Measured once each, one after the
other, a ratio between kvslim and a peer carries whatever the host did between the two runs: on a shared virtual
machine the same step moved by up to 30% between runs minutes apart (docs/performance.md, "The compiled step's
fixed costs"). With ``--peer-rounds N`` the bench measures kvslim's modes, then the peers, then kvslim's modes
again, and so on, N times (each kvslim mode's caches prefilled once), and reports:

- one row per mode, length and concurrency (:func:`merge_rounds`): the row of its *median round* (the round whose
  median step is the median of the rounds'; the lower of the two middle ones for an even N), with every round's
  median step in ``rounds_ms``, in order;
- for every peer row and every kvslim row at the same length and concurrency (:func:`round_ratios`), the peer's
  median step over kvslim's in each round (its time / ours: above 1, kvslim is faster), and the median of those
  ratios: a pair of neighbouring runs per round, not two medians taken apart.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import replace

from .concurrency import ConcurrencyRow

#: kinds of the rows kvslim's own engine measures (the plain cache's is ``dynamic``, transformers' continuous
#: batching's and the peers' ``peer``)
KVSLIM_KINDS = ("kvslim", "pages")


def _key(row: ConcurrencyRow) -> tuple:
    return row.mode, row.length, row.concurrency


def _ms(row: ConcurrencyRow) -> float | None:
    """The row's median step, or None where it has none (a failed peer run: NaN)."""
    return row.ms_median if row.ms_median == row.ms_median and row.steps else None


def merge_rounds(rounds: Sequence[Sequence[ConcurrencyRow]]) -> list[ConcurrencyRow]:
    """One row per (mode, length, concurrency) of ``rounds`` (each round's rows), in the order they first appear.
    With one round, its rows as they are. Else a copy of the median round's row, with ``rounds_ms`` (every round's
    median step, None for a round that failed), or of its only row where one round measured it; either with
    ``ratio_to_dynamic`` left for :func:`~.concurrency.link_ratios` to fill from the merged ``dynamic`` row."""
    seen: dict[tuple, list[ConcurrencyRow]] = {}
    for rows in rounds:
        for row in rows:
            seen.setdefault(_key(row), []).append(row)
    out = []
    for runs in seen.values():
        # (a row measured in one round only: transformers' continuous batching is run in the first)
        if len(runs) == 1:
            out.append(runs[0] if len(rounds) == 1 else replace(runs[0], ratio_to_dynamic=None))
            continue
        timed = sorted((r for r in runs if _ms(r) is not None), key=lambda r: r.ms_median)
        pick = timed[(len(timed) - 1) // 2] if timed else runs[0]
        out.append(replace(pick, rounds_ms=[_ms(r) for r in runs], ratio_to_dynamic=None))
    return out


def round_ratios(kvslim_rounds: Sequence[Sequence[ConcurrencyRow]],
                 peer_rounds: Sequence[Sequence[ConcurrencyRow]]) -> list[dict]:  # fmt: skip
    """For each peer row and each kvslim engine row at the same length and concurrency: ``{"peer", "kvslim",
    "length", "concurrency", "rounds", "median"}``, ``rounds`` the peer's median step over kvslim's in each round
    where both were measured (its time / ours), ``median`` their median (None where no round had both)."""
    if len(kvslim_rounds) != len(peer_rounds):
        raise ValueError(f"{len(kvslim_rounds)} rounds of kvslim's rows but {len(peer_rounds)} of the peers'")
    pairs: dict[tuple, list[float]] = {}
    for ours, theirs in zip(kvslim_rounds, peer_rounds, strict=True):
        mine = [r for r in ours if r.kind in KVSLIM_KINDS]
        for p in theirs:
            for k in mine:
                if (k.length, k.concurrency) != (p.length, p.concurrency):
                    continue
                ratios = pairs.setdefault((p.mode, k.mode, p.length, p.concurrency), [])
                if _ms(p) is not None and _ms(k) is not None:
                    ratios.append(p.ms_median / k.ms_median)
    return [
        {"peer": peer, "kvslim": mode, "length": length, "concurrency": c, "rounds": ratios,
         "median": statistics.median(ratios) if ratios else None}
        for (peer, mode, length, c), ratios in pairs.items()
    ]  # fmt: skip


def render_round_ratios(ratios: Sequence[dict], n: int) -> str:
    """The ratios of :func:`round_ratios` as text, a line per pair."""
    lines = [f"peer step / kvslim step in each of {n} rounds (above 1: kvslim is faster), and the median"]
    width = max((len(r["peer"]) + len(r["kvslim"]) for r in ratios), default=0) + 3
    for r in ratios:
        each = " ".join(f"{x:.3f}" for x in r["rounds"]) or "-"
        median = "-" if r["median"] is None else f"{r['median']:.3f}"
        pair = f"{r['peer']} / {r['kvslim']}"
        lines.append(f"{pair:<{width}} L={r['length']} C={r['concurrency']}: {each}   median {median}")
    return "\n".join(lines)
