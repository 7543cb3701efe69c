"""Which positions a layer keeps: everything, or StreamingLLM's sinks + window.

Xiao et al., 2023, "Efficient Streaming Language Models with Attention Sinks": keep the first
``sink`` tokens (they anchor softmax) and the last ``window`` tokens; evict the middle. Without a
window nothing is evicted, and ``sink`` only says which tokens the layer keeps apart, at full
precision: RotateKV's attention-sink-aware quantization (Su et al., 2025) — the first tokens' keys sit
far from every other key, and a quantizer (or a mean-centering bias) fitted to the others serves them
badly (docs/quality.md).

This module decides *how many* tokens go where and *how many* leave; it knows nothing about storage,
codecs or RoPE (see :mod:`kvslim.cache.layer`). Deviations from the paper, all deliberate:

- Positions are not decided here. kvslim offers both the paper's in-cache positions (the kept
  tokens presented as one contiguous sequence) and the "vanilla" variant (every key keeps the
  rotation of its original position; queries use their true position): ``positions=`` on the
  cache, implemented in :mod:`kvslim.cache.frames` by re-rotating the full-precision sinks only.
- Eviction happens after the append, so a decode step attends to ``sink + window + 1`` keys and a
  multi-token chunk attends to everything stored before it plus itself (causally) — the paper's
  reference code (``evict_for_space``) likewise never evicts inside a forward pass.
- Left padding (batch > 1): pads are not sinks. Row ``b`` with ``p_b`` pads keeps as sinks the
  ``sink`` positions starting at ``min(p_b, seen - sink - window)``: while the row still has pads
  inside its kept span, its "sinks" slide with the window (they are the oldest kept positions), and
  they freeze on the row's first real tokens once the pads have left. With that rule every row's
  kept positions, read slot by slot, line up with the last ``stored`` columns of the usual 2-D
  attention mask, so the standard padding mask stays exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KeepPolicy:
    """sink >= 0 first tokens kept apart (forever), window > 0 most recent tokens, or window None: keep all."""

    sink: int = 0
    window: int | None = None

    @property
    def bounded(self) -> bool:
        return self.window is not None

    @property
    def capacity(self) -> int | None:
        return None if self.window is None else self.sink + self.window

    def n_to_sinks(self, sink_len: int, n_new: int) -> int:
        """How many of ``n_new`` arriving tokens fill the sink segment (the first tokens seen)."""
        return max(0, min(self.sink - sink_len, n_new))

    def n_to_evict(self, stored: int) -> int:
        """How many of the oldest non-sink tokens leave once ``stored`` tokens are held."""
        if not self.bounded:
            return 0
        return max(0, stored - self.capacity)

    def sink_starts(self, seen: int, pads: torch.Tensor) -> torch.Tensor:
        """Per row, the first position of its sink segment after eviction: ``min(pads, seen - capacity)``.

        pads: (B,) left-padding count of each row. Returns (B,) int64.
        """
        return torch.clamp(pads, max=max(0, seen - self.capacity))
