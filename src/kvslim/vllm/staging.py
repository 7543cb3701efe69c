"""Staged partial pages: the partly filled last page of a sequence kept at full precision outside the codes.

kvslim's own cache leaves a partly filled group of up to 31 newest tokens unencoded until its 32nd token arrives
(tokens leave the residual a group at a time: :mod:`kvslim.cache`); a vLLM page is that group. Here each page
that is being filled gets a *staging slot*: a copy of its tokens so far in the model's dtype, in a fixed pool
per layer (``(slots, H_kv, 32, 2 * D * dtype size)`` uint8, rows in the ``none`` layout: K then V), and the
kernel reads a page's cached tokens from its slot instead of its codes while the page has one
(``csrc/kvslim_paged.c``, "Staged pages").

The codes are still written as each token arrives (every page format in the plugin encodes a token on its own:
GGML blocks and the affine rows are per token), so a slot only ever *raises* precision: a page without a slot
(the pool full, a slot evicted) is read from its codes, correctly. Nothing is re-encoded.

The page-to-slot map is one per engine (every layer writes the same slots each step), planned once per step by
:class:`Stager` from vLLM's slot mapping, before the layers run:

- a write at offset 0 of a page starts it: it gets a slot (its old one, if the page id had one: vLLM reuses the
  block ids of finished requests, and a reused page's first write is always at offset 0 — a new request's
  tokens start at a block boundary, a prefix-cache hit is whole blocks — so a stale copy is dropped there);
- the page's later writes (offsets > 0) go to its slot, if it still has one;
- a write at offset 31 fills it: its slot is released at the next step's plan (this step still reads it);
  a page filled in the very step that starts it (a prefill) needs no slot;
- a full page (the only kind vLLM's prefix cache shares) has no slot, so a shared page is always read from
  its codes;
- when every slot is taken, the one written least recently (not in this step, not a sink page) is evicted: its
  page falls back to its codes.

Sink pages (``sink=N`` in the spec, no window): the first ``ceil(N / 32)`` pages of every running sequence stay
staged once filled, so the attention sink (a sequence's first tokens, which draw a large share of every query's
attention) is read at full precision for as long as a running sequence starts with that page — kvslim's own
cache's ``sink`` without a window (RotateKV's attention-sink-aware quantization), whole pages at a time. The
builder hands each step's sink page ids (:meth:`Stager.plan`: the first pages of the sequences scheduled in that
step); a sink page is staged from its first write (also when a prefill fills it in one step) and kept when it
fills. It is never evicted in a step that names it; in a step that does not (its sequence finished, or was not
scheduled in that step) it stays staged but may be evicted like any slot, least recently written first. Kept
staged is always correct: a page id's content changes only through a new first write at offset 0, which stages it
anew, and a prefix-cache hit on a still-staged sink page reads the same tokens at full precision. A page that was
already full and unstaged when it became a sink is read from its codes.

Memory: ``slots x layers x H_kv x 32 x 2 x D x dtype size`` bytes outside vLLM's KV space, ``slots`` =
vLLM's ``max_num_seqs`` times (1 + sink pages) unless ``$KVSLIM_VLLM_STAGED_SLOTS`` says otherwise (0: no staging); docs/vllm.md
counts it against the capacity.

This module imports nothing of vLLM.
"""

from __future__ import annotations

import os

import torch

from .pages import PAGE_TOKENS

#: ``$KVSLIM_VLLM_STAGED_SLOTS``: staging slots per layer (default: vLLM's max_num_seqs; 0: no staging).
SLOTS_ENV = "KVSLIM_VLLM_STAGED_SLOTS"


def slots_from_env(default: int, environ=None) -> int:
    """The number of staging slots: ``$KVSLIM_VLLM_STAGED_SLOTS`` or ``default`` (ValueError in one line for a bad
    value)."""
    environ = os.environ if environ is None else environ
    text = environ.get(SLOTS_ENV, "").strip()
    if not text:
        return default
    if not text.isdigit():
        raise ValueError(
            f"kvslim: ${SLOTS_ENV} must be a whole number of slots (0: no staging), got {text!r}"
        )
    return int(text)


def pool_bytes(slots: int, layers: int, kv_heads: int, head_dim: int, dtype_size: int) -> int:
    """Bytes of an engine's staging pools: slots x layers x H_kv x 32 tokens x (K and V) x D x dtype size."""
    return slots * layers * kv_heads * PAGE_TOKENS * 2 * head_dim * dtype_size


class Stager:
    """The page-to-slot map of one engine and its plan for each step (module docstring).

    ``map``: int32 (pages seen,) page id -> slot or -1, handed to the kernel as is (a page beyond its end has
    no slot)."""

    def __init__(self, slots: int, tokens: int = PAGE_TOKENS, sink_pages: int = 0) -> None:
        if slots < 1:
            raise ValueError(f"kvslim: a staging pool needs at least one slot, got {slots}")
        self.slots, self.tokens = slots, tokens
        #: the first pages of every sequence kept staged (module docstring, "Sink pages")
        self.sink_pages = sink_pages
        self.map = torch.full((0,), -1, dtype=torch.int32)
        self._page = [-1] * slots  # slot -> page
        self._last = [0] * slots  # slot -> the step that last wrote it
        self._free = list(range(slots - 1, -1, -1))
        self._release: list[int] = []  # pages filled in the last step
        self._step = 0

    def _grow(self, pages: int) -> None:
        if pages > self.map.shape[0]:
            grown = torch.full((max(pages, 2 * self.map.shape[0]),), -1, dtype=torch.int32)
            grown[: self.map.shape[0]] = self.map
            self.map = grown

    def _drop(self, page: int) -> None:
        slot = int(self.map[page])
        if slot >= 0:
            self.map[page] = -1
            self._page[slot] = -1
            self._free.append(slot)

    def forget(self, pages) -> None:
        """Drop the slots of ``pages``, whose ids now hold other tokens (kvslim's engine frees a row's pages, and may
        fill them again without a first write at offset 0: a copied row's pages), or whose tokens are to be read
        from their codes from now on (a page leaving a row's residual, :mod:`kvslim.cache.pagepool`)."""
        for page in pages:
            if 0 <= page < self.map.shape[0]:
                self._drop(page)
        gone = set(pages)
        self._release = [p for p in self._release if p not in gone]

    def copy(self, src: int, dst: int) -> tuple[int, int] | None:
        """Page ``dst`` is to hold ``src``'s tokens (kvslim's engine copying a row): if ``src`` is staged, ``dst`` takes a
        free slot and is staged alike (filled or not), and ``(src's slot, dst's slot)`` is returned for the caller to
        copy the slot's rows; None where ``src`` has no slot. RuntimeError where no slot is free (nothing changes)."""
        slot = int(self.map[src]) if 0 <= src < self.map.shape[0] else -1
        if slot < 0:
            return None
        if not self._free:
            raise RuntimeError("kvslim: no free staging slot for a copied page")
        self._grow(dst + 1)
        self._drop(dst)
        mine = self._free.pop()
        self.map[dst], self._page[mine], self._last[mine] = mine, dst, self._last[slot]
        if src in self._release:
            self._release.append(dst)
        return slot, mine

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def state(self) -> tuple:
        """Everything :meth:`plan`, :meth:`forget` and :meth:`copy` change, for :meth:`restore` (a step abandoned)."""
        return (self.map.clone(), list(self._page), list(self._last), list(self._free), list(self._release), self._step)

    def restore(self, state: tuple) -> None:
        """Back to :meth:`state`'s moment."""
        m, self._page, self._last, self._free, self._release, self._step = (
            state[0],
            list(state[1]),
            list(state[2]),
            list(state[3]),
            list(state[4]),
            state[5],
        )
        self.map = m.clone()

    def _take(self, page: int, pinned: set) -> int:
        """A slot for ``page`` (free, else the least recently written one neither written this step nor holding a
        sink page in ``pinned``), or -1."""
        if self._free:
            slot = self._free.pop()
        else:
            free = [i for i in range(self.slots) if self._last[i] != self._step and self._page[i] not in pinned]
            if not free:
                return -1  # more pages being filled (or sinks) in this step than slots: the rest read their codes
            slot = min(free, key=self._last.__getitem__)
            self.map[self._page[slot]] = -1
        self.map[page] = slot
        self._page[slot] = page
        return slot

    def plan(self, slot_mapping: torch.Tensor, sinks=()) -> torch.Tensor:
        """One step's writes: slot_mapping (N,) integer (vLLM's: slot ``s`` = page ``s // T``, offset ``s % T``;
        negative: padding) -> (N,) int64, each token's row in the staging pool (``slot * T + offset``) or -1
        (not staged). sinks: the page ids kept staged once filled and never evicted in this step: the first
        :attr:`sink_pages` pages of a running sequence in this step (:func:`sink_pages_of`), and for kvslim's page pool
        also each row's residual pages (:mod:`kvslim.cache.pagepool`). Updates :attr:`map` for this step."""
        self._step += 1
        pinned = set(sinks)
        for page in self._release:
            if page not in pinned:  # a sink page stays staged, full
                self._drop(page)
        self._release = []
        s = slot_mapping.long().cpu()
        dest = torch.full_like(s, -1)
        valid = s >= 0
        if not bool(valid.any()):
            return dest
        t = self.tokens
        pages, off = s[valid] // t, s[valid] % t
        self._grow(int(pages.max()) + 1)
        uniq, inv = torch.unique(pages, return_inverse=True)
        first = torch.full((uniq.shape[0],), t, dtype=torch.int64).scatter_reduce(0, inv, off, "amin")
        last = torch.full((uniq.shape[0],), -1, dtype=torch.int64).scatter_reduce(0, inv, off, "amax")
        slot_of = torch.full((uniq.shape[0],), -1, dtype=torch.int64)
        for i, (page, a, b) in enumerate(zip(uniq.tolist(), first.tolist(), last.tolist())):
            slot = int(self.map[page])
            if a == 0:  # the page starts (new, or a reused page id: a stale copy is dropped)
                if b == t - 1 and page not in pinned:  # filled in the step that starts it: nothing to stage
                    self._drop(page)
                    continue
                if slot < 0:
                    slot = self._take(page, pinned)
                    if slot < 0:
                        continue
            elif slot < 0:  # not staged (evicted, or begun without a slot): its codes
                continue
            if b == t - 1:
                self._release.append(page)
            self._last[slot] = self._step
            slot_of[i] = slot
        rows = slot_of[inv]
        dest[valid] = torch.where(rows >= 0, rows * t + off, -1)
        return dest


def overlay(
    kv: tuple[torch.Tensor, torch.Tensor], staged_kv, smap: torch.Tensor, blocks: torch.Tensor, length: int
):
    """The torch reference's view of staging: ``kv`` (K, V) fp32 (H, length, D), a row's first ``length`` tokens
    decoded from its pages, with each staged page's tokens replaced by its slot's.

    staged_kv: (K, V) fp32 (slots, H, T, D), the pool decoded; smap: int32 page -> slot; blocks: the row's block
    table."""
    k, v = (x.clone() for x in kv)
    sk, sv = staged_kv
    t = sk.shape[2]
    for j in range(-(-length // t)):
        page = int(blocks[j])
        slot = int(smap[page]) if 0 <= page < smap.shape[0] else -1
        if slot >= 0:
            n = min(t, length - j * t)
            k[:, j * t : j * t + n] = sk[slot, :, :n]
            v[:, j * t : j * t + n] = sv[slot, :, :n]
    return k, v


def sink_pages_of(block_table: torch.Tensor, seq_lens: torch.Tensor, n: int) -> list[int]:
    """The page ids of the first ``n`` pages of each running sequence that has reached them: block_table (R', B)
    integer (R' >= R rows), seq_lens (R,) tokens per sequence (its pages beyond ``ceil(len / 32)`` are not its yet)."""
    if n <= 0 or seq_lens.numel() == 0:
        return []
    r = seq_lens.shape[0]
    pages = block_table[:r, :n].long().cpu()
    have = (seq_lens.long().cpu()[:, None] + PAGE_TOKENS - 1) // PAGE_TOKENS  # pages each sequence has
    keep = torch.arange(pages.shape[1])[None, :] < have
    return pages[keep].tolist()
