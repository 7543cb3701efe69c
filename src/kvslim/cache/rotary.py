"""Rotary position embedding (RoPE) as kvslim needs it: moving an already-rotated key to another position.

Su et al., 2021, "RoFormer": a key at position ``p`` is stored as ``R(p) k``, where ``R(p)`` rotates
channel pair ``(i, i + R/2)`` by the angle ``p * inv_freq[i]`` (the "rotate_half" layout of Llama and
most transformers models; ``R = 2 * len(inv_freq)`` leading channels rotate, the rest pass through).
Rotations compose, ``R(a) R(b) = R(a + b)``, so a key rotated for position ``p`` is moved to ``p + d``
by ``R(d)`` alone — no need to know ``p``. The score ``q . k`` depends only on the distance between
the query's and the key's positions; that is what StreamingLLM's in-cache positions and the
bounded position ids of :mod:`kvslim.generate` change (see docs/streaming.md).

Precision: angles ``d * inv_freq`` are formed in float64 (a distance of 2^24 keeps ~1e-9 rad), the
rotation itself runs in float32 and the result returns in the input's dtype. A zero distance is never
applied (the key is returned untouched), so modes that do not move a key stay bit-exact.

``attention_scaling`` (YaRN's mscale) multiplies cos/sin in the model; a key already carries it once,
so a move applies the pure rotation. This module knows nothing about transformers: the adapter
(:mod:`kvslim.cache.adapter`) reads ``inv_freq`` from the model's own rotary module.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

#: distances whose angles :meth:`Rotary.move` keeps (a window's re-bases leave one or two at a time)
KEPT_DISTANCES = 16


@dataclass(frozen=True)
class Rotary:
    """The rotation of one model: ``inv_freq`` (R/2,) — channels ``offset .. offset + R`` of each key
    rotate (``offset`` 0: the leading channels, as in Llama or partial-rotary Phi; DeepSeek's MLA keys
    carry their rotary part after ``qk_nope_head_dim`` unrotated channels)."""

    inv_freq: torch.Tensor
    offset: int = 0
    #: the angle table :meth:`table` keeps over a range of positions (every layer of a forward reads it)
    _memo: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def rotary_dim(self) -> int:
        return 2 * self.inv_freq.shape[0]

    def cos_sin(self, delta: torch.Tensor, device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of ``delta[...] * inv_freq`` duplicated over both halves: (*delta.shape, R) float32."""
        freqs = delta.to(device=device, dtype=torch.float64)[..., None] * self.inv_freq.to(
            device=device, dtype=torch.float64
        )  # (..., R/2)
        emb = torch.cat([freqs, freqs], dim=-1)  # (..., R)
        return emb.cos().float(), emb.sin().float()

    def table(self, positions: torch.Tensor, device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of ``positions[b, t] * inv_freq[i]``: (B, T, R/2) float32 each, angles in float64.

        Pre-RoPE keys are rotated on read by these angles (:class:`kvslim.kernels.KeyTransform`). Rows of
        consecutive positions (the usual case) are served as views into a table kept over a range of
        positions, which grows by at least a quarter when a forward reaches past it — amortized O(new
        positions) per step, shared by every layer; other position sets are computed directly. The kept
        table counts in :meth:`nbytes`. The result must not be written."""
        device = torch.device(device)
        b, t = positions.shape
        if t == 0:
            empty = torch.empty(b, 0, self.inv_freq.shape[0], device=device)
            return empty, empty
        first = positions[:, :1]
        if not bool((positions - first == torch.arange(t, device=positions.device)).all()):
            return self._angles(positions.to(device))
        starts = [int(p) for p in first[:, 0].tolist()]
        lo, hi = min(starts), max(starts) + t
        kept = self._memo.get("range")
        if kept is None or kept[2] != str(device) or lo < kept[0] or hi > kept[1]:
            if kept is not None and kept[2] == str(device):
                lo, hi = min(lo, kept[0]), max(hi, kept[1])
            hi += max(64, (hi - lo) // 4)  # room for the next positions
            cos, sin = self._angles(torch.arange(lo, hi, device=device)[None])
            kept = (lo, hi, str(device), cos[0], sin[0])
            self._memo["range"] = kept
        base, rc, rs = kept[0], kept[3], kept[4]
        if len(set(starts)) == 1:
            s = starts[0] - base
            return rc[None, s : s + t].expand(b, -1, -1), rs[None, s : s + t].expand(b, -1, -1)
        cos = torch.stack([rc[s - base : s - base + t] for s in starts])
        sin = torch.stack([rs[s - base : s - base + t] for s in starts])
        return cos, sin

    def _angles(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (B, T, R/2) float32 of positions (B, T) times inv_freq, computed in float64."""
        freqs = positions.to(dtype=torch.float64)[..., None] * self.inv_freq.to(
            device=positions.device, dtype=torch.float64
        )
        return freqs.cos().float(), freqs.sin().float()

    def rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``R(positions[b, t])`` applied to x (B, H, T, D) — pre-RoPE keys rotated to their positions — with the
        angles of :meth:`table` (shared by the layers of a forward). Returns float32."""
        cos, sin = self.table(positions, x.device)  # (B, T, R/2)
        cos, sin = cos[:, None], sin[:, None]
        o, h = self.offset, cos.shape[-1]
        out = x.float().clone()
        a, b = out[..., o : o + h], out[..., o + h : o + 2 * h]
        out[..., o : o + h], out[..., o + h : o + 2 * h] = a * cos - b * sin, b * cos + a * sin
        return out

    def nbytes(self) -> int:
        """Bytes held: the frequencies, the kept range of :meth:`table` and the distances :meth:`move` keeps."""
        n = self.inv_freq.numel() * self.inv_freq.element_size()
        kept = self._memo.get("range")
        if kept is not None:
            n += sum(x.numel() * x.element_size() for x in kept[3:])
        for memo in ("one", "rows"):  # ("rows": only while a forward runs, Rotary.rows_angles)
            for pair in self._memo.get(memo, {}).values():
                n += sum(x.numel() * x.element_size() for x in pair)
        return n

    def _one(self, delta: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (R,) of one distance, as :meth:`cos_sin` computes them, kept for the next layers and steps
        (a re-based run moves every layer's queries by the same distance until its keys leave; at most
        :data:`KEPT_DISTANCES` distances are kept, the oldest dropped)."""
        kept = self._memo.setdefault("one", {})
        key = (delta, str(device))
        got = kept.get(key)
        if got is None:
            got = self.cos_sin(torch.tensor(delta), device)
            if len(kept) >= KEPT_DISTANCES:
                kept.pop(next(iter(kept)))
            kept[key] = got
        return got

    def rows_angles(self, delta: tuple, device) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`move_angles` of ``delta``, distances per row and token as a tuple of per-row tuples (a stream's
        sinks, :meth:`kvslim.cache.frames.Frames.sink_delta`), kept for the next layers: every layer of a forward
        moves a stream's sinks by the same distances, and the next forward by others (only the last distances are
        kept, until :meth:`forget_rows`: the cache's last layer drops them, so they are a forward's transient, not a
        cache's bytes). The same values as computing them again, so the same bits."""
        key = (delta, str(device))
        kept = self._memo.get("rows", {})
        got = kept.get(key)
        if got is None:
            got = self.move_angles(torch.tensor(delta, dtype=torch.long, device=device), device)
            self._memo["rows"] = {key: got}
        return got

    def forget_rows(self) -> None:
        """Drop the angles :meth:`rows_angles` keeps (the end of a forward)."""
        self._memo.pop("rows", None)

    def move_angles(self, delta: torch.Tensor, device) -> tuple[torch.Tensor, torch.Tensor]:
        """The angles :meth:`move` uses for distances ``delta`` (B, T) int64: cos, sin (B, 1, T, R) float32. A
        caller that moves by the same distances many times (a ragged step's sinks, once a layer) computes them
        once and hands them to :meth:`move` (``angles=``): the same values, so the same bits."""
        cos, sin = self.cos_sin(delta, device)  # (B, T, R)
        return cos[:, None], sin[:, None]

    def move(
        self, x: torch.Tensor, delta: torch.Tensor | int | None, angles: tuple | None = None
    ) -> torch.Tensor:
        """``R(delta) x`` for x (B, H, T, D) rotated keys or queries.

        delta: an int, a (B,) tensor (one distance per row), or (B, T) (per row and token); or None with
        ``angles``, :meth:`move_angles` of nonzero (B, T) distances. Returns a new tensor in x's dtype; x itself
        when every distance is zero.
        """
        b, _, t, d = x.shape
        r, o = self.rotary_dim, self.offset
        if o + r > d:
            raise ValueError(f"rotary channels {o}..{o + r} exceed head_dim {d}")
        if angles is not None:
            cos, sin = angles
        else:
            if not isinstance(delta, torch.Tensor):
                delta = torch.tensor(int(delta))
            if not bool((delta != 0).any()):
                return x
            if delta.ndim == 0:  # one distance for everything (a run's queries): its angles kept, per device
                cos, sin = self._one(int(delta), x.device)  # (R,): the elements cos_sin gives each (b, t)
            else:
                if delta.ndim == 1:
                    delta = delta[:, None].expand(b, t)  # (B, T)
                cos, sin = self.move_angles(delta, x.device)  # (B, 1, T, R)
        xf = x.float()
        rot = xf[..., o : o + r]
        half = r // 2
        rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)  # rotate_half
        out = xf.clone()
        out[..., o : o + r] = rot * cos + rotated * sin
        return out.to(x.dtype)


def by_rotation(items, memo: dict | None = None):
    """``items`` (``(rotary, payload)`` pairs) grouped by equal rotation: a list of ``(rotary, [payload, ...])``,
    in first-seen order. Rows of a ragged step hold copies of the model's rotary (one per cache), so equal means
    the same offset and frequencies, not the same object. memo: a dict the caller keeps while every rotary it
    names is alive (a step): each pair is compared once, not once a layer."""
    groups: list = []
    for rot, payload in items:
        for first, members in groups:
            if first is rot or _equal(first, rot, memo):
                members.append(payload)
                break
        else:
            groups.append((rot, [payload]))
    return groups


def _equal(a: Rotary, b: Rotary, memo: dict | None) -> bool:
    key = ("equal", id(a), id(b))
    if memo is not None and key in memo:
        return memo[key]
    same = (
        a.offset == b.offset and a.inv_freq.shape == b.inv_freq.shape and torch.equal(a.inv_freq, b.inv_freq)
    )
    if memo is not None:
        memo[key] = same
    return same


def rotate_half_reference(x: torch.Tensor) -> torch.Tensor:
    """The "rotate_half" layout this module implements, for probing a model's own function."""
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)
