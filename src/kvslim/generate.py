"""Every forward pass kvslim makes goes through here: the one decode loop, the one owner of positions.

gpt-fast-style free functions that ``sample``, ``eval``, ``bench``, ``calibrate`` and the tests share:

- :func:`forward` — the only place that calls ``model(...)``: new tokens in, logits out, position ids
  from :func:`position_ids`;
- :func:`prefill` feeds a prompt (in chunks if asked) and returns the last position's logits;
- :func:`decode_one_token` feeds one token per row and returns its logits;
- :func:`forward_step` feeds many batch-1 caches in one forward, each its own new tokens (the batch engine's
  step: decode tokens and prompt chunks packed together); :func:`forward_rows` is its one-token-a-row case;
- :func:`teacher_forced` feeds a known text chunk by chunk and yields the logits of every position
  (perplexity, KLD);
- :func:`greedy` continues a prompt greedily, one decode step per token;
- :func:`sample_next` turns logits into token ids (greedy at temperature 0, else top-p sampling);
- :func:`generate` runs the sampling loop and yields a :class:`TokenEvent` per step, keeping live
  :class:`GenerationStats` (readable even after a KeyboardInterrupt);

Positions come from :mod:`kvslim.cache.positions` (the one owner of position ids, padding and bases): every
forward here builds its ids there, and nowhere else in kvslim are they built.

This module knows nothing about how the cache stores tokens: any transformers ``Cache`` works; only
:class:`~kvslim.SlimCache` is told the padding (it needs it to choose per-row sinks).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from .cache.positions import hand_padding, left_pad_position_ids, left_padding, position_ids  # noqa: F401 - re-exported
from .checks import check_int
from .compiled import compiled_decode

# ---------------------------------------------------------------------------------------------
# forwards


def forward(
    model,
    input_ids: torch.Tensor,
    cache,
    *,
    pads: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    logits_to_keep: int = 1,
) -> torch.Tensor:
    """Feed ``input_ids`` (B, C) through ``cache``; the one call of ``model(...)`` in kvslim.

    pads: (B,) left padding of the run (None: none); a fresh :class:`~kvslim.SlimCache` is handed it here.
    attention_mask: (B, seen + C) of 0/1 covering every token fed so far, or None (no padding).
    logits_to_keep: 0 keeps every position, k > 0 the last k. Returns (B, kept, V) float32.
    """
    hand_padding(cache, pads)
    pos = position_ids(cache, input_ids.shape[1], pads=pads, device=input_ids.device)
    from .compat import cache_kwargs  # the cache keyword depends on the transformers release

    compiled = compiled_decode(model)
    if compiled is not None and input_ids.shape[1] == 1 and logits_to_keep == 1:
        if attention_mask is not None and bool(attention_mask.all()):
            attention_mask = None  # a mask without padding masks nothing (a padded batch stays eager)
        if attention_mask is None and compiled.serves(cache) and _allocated(cache):
            # a fixed-shape cache's decode step: the compiled graph (kvslim.compiled)
            return compiled(input_ids=input_ids, position_ids=pos, cache_kwargs=cache_kwargs(cache)).float()
    kwargs = {} if attention_mask is None else {"attention_mask": attention_mask}
    kwargs.update(cache_kwargs(cache))
    out = model(
        input_ids=input_ids, use_cache=True, position_ids=pos, logits_to_keep=logits_to_keep, **kwargs
    )
    return out.logits.float()


def _allocated(cache) -> bool:
    """Whether every layer of ``cache`` has its buffers (a compiled step never allocates: the first forward
    through a fresh cache runs eagerly)."""
    return all(getattr(layer, "is_initialized", True) for layer in cache.layers)


#: Ragged steps are padded to a multiple of this many tokens (:mod:`kvslim.cache.ragged`, "Filler rows"): then a
#: token's logits do not depend on how many tokens share its step (scripts/blas_row_invariance.py). The engine
#: passes 1 where every product is kvslim's own (:meth:`kvslim.engine.linears.Linears.row_multiple`).
ROW_MULTIPLE = 4


def forward_rows(
    model,
    tokens: Sequence[int],
    caches: Sequence,
    *,
    row_multiple: int = ROW_MULTIPLE,
    errors: dict | None = None,
) -> torch.Tensor:
    """One ragged decode step, token ``tokens[b]`` through ``caches[b]``: :func:`forward_step` with one token
    a row. Returns (len(caches), V) float32, row ``b``'s logits whatever other rows share the step."""
    if len(tokens) != len(caches) or not caches:
        raise ValueError(
            f"forward_rows needs one token per cache, got {len(tokens)} tokens for {len(caches)} caches"
        )
    return forward_step(
        model, [([t], c) for t, c in zip(tokens, caches, strict=True)], row_multiple=row_multiple, errors=errors
    )


def forward_step(
    model,
    feeds: Sequence[tuple[Sequence[int], object]],
    *,
    row_multiple: int = ROW_MULTIPLE,
    errors: dict | None = None,
) -> torch.Tensor:
    """ONE forward for many caches: ``feeds[b] = (token ids, cache)`` — a decoding row's token or a prompt
    chunk — packed into one sequence (:mod:`kvslim.cache.ragged`, "Packed, not padded"; filler tokens round it
    up to a multiple of ``row_multiple``). caches: batch-1 :class:`~kvslim.SlimCache` objects of one model
    (built with ``config=``), each at most once; the model uses the ``kvslim`` attention. Row ``b``'s position
    ids are :func:`position_ids` of its own cache. Returns (len(feeds), V) float32: each row's LAST token's
    logits, bit-identical to the row fed the same tokens in a step of its own or among any others.

    errors: None (a row whose K/V its cache refuses, or whose attention raises, raises) or a dict: such a row
    is dropped instead, ``errors[b]`` holds why, the other rows' logits are exact; row ``b``'s cache took its
    tokens in some layers and must not be fed again. When every row fails, the first failure raises."""
    from .cache.ragged import RaggedCache
    from .compat import cache_kwargs

    check_int("row_multiple", row_multiple, minimum=1)
    if not feeds:
        raise ValueError("forward_step needs at least one (tokens, cache) row")
    if len({id(c) for _, c in feeds}) != len(feeds):
        raise ValueError("forward_step feeds each cache at most once a step")
    device = model.device
    ids: list[int] = []
    rows, pos_ids = [], []  # rows: (cache, first position id, base, new tokens)
    for b, (tokens, cache) in enumerate(feeds):
        tokens = list(tokens)
        if not tokens:
            raise ValueError(f"forward_step row {b} has no tokens to feed")
        hand_padding(cache, None)  # a fresh cache learns it has no padding (what prefill() tells it)
        pos = position_ids(cache, len(tokens), device=device)  # (1, n)
        first = int(pos[0, 0])
        rows.append((cache, first, int(cache.get_seq_length()) - first, len(tokens)))
        pos_ids.append(pos[0])
        ids += tokens
    caches, positions, bases, lengths = (list(column) for column in zip(*rows, strict=True))
    n_rows = len(feeds)
    fill = -len(ids) % row_multiple  # filler rows, one token each (cache None, token 0, position 0)
    caches, positions, bases = caches + [None] * fill, positions + [0] * fill, bases + [0] * fill
    lengths, ids = lengths + [1] * fill, ids + [0] * fill
    pos_ids.append(torch.zeros(fill, dtype=torch.long, device=device))
    input_ids = torch.tensor([ids], dtype=torch.long, device=device)  # (1, N)
    pos = torch.cat(pos_ids)[None]  # (1, N)
    # each row's last token: the lm_head rows kept, padded to a multiple as well (the last token repeated)
    last = torch.tensor(lengths[:n_rows], device=device).cumsum(0) - 1  # (n_rows,)
    keep = torch.cat([last, last.new_full((-n_rows % row_multiple,), len(ids) - 1)])
    dropped: dict | None = None if errors is None else {}
    ragged = RaggedCache(caches, positions, bases, errors=dropped, lengths=lengths)
    try:
        out = model(input_ids=input_ids, use_cache=True, position_ids=pos, logits_to_keep=keep, **cache_kwargs(ragged))
    finally:
        if errors is not None:
            errors.update({b: e for b, e in dropped.items() if b < n_rows})
    return out.logits[0, :n_rows].float()


def prefill(
    model,
    input_ids: torch.Tensor,
    cache,
    *,
    attention_mask: torch.Tensor | None = None,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Feed the prompt through ``cache`` and return the logits of its last position.

    input_ids: (B, T); attention_mask: (B, T) of 0/1 with left padding, or None (no padding); a
    :class:`~kvslim.SlimCache` is handed the padding here, once.
    chunk_size: feed at most this many tokens per forward (None: all at once); every chunk goes
    through the same cache, so the result equals a one-shot prefill up to float rounding.
    Returns (B, V) float32.
    """
    if input_ids.ndim != 2 or input_ids.shape[1] == 0:
        raise ValueError(
            f"input_ids must be (batch, tokens) with tokens >= 1, got shape {tuple(input_ids.shape)}"
        )
    if chunk_size is not None:
        check_int("chunk_size", chunk_size, minimum=1, expected="a positive integer or None")
    if attention_mask is not None and attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"attention_mask shape {tuple(attention_mask.shape)} != input_ids shape {tuple(input_ids.shape)}"
        )
    pads = None if attention_mask is None else left_padding(attention_mask)
    T = input_ids.shape[1]
    step = chunk_size or T
    logits = None
    for start in range(0, T, step):
        end = min(start + step, T)
        # The 2D mask covers every token seen so far (cached + this chunk), as transformers expects.
        mask = None if attention_mask is None else attention_mask[:, :end]
        logits = forward(model, input_ids[:, start:end], cache, pads=pads, attention_mask=mask)[:, -1]
    return logits


def decode_one_token(
    model,
    token: torch.Tensor,
    cache,
    *,
    pads: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Feed one token per row. token: (B, 1); pads: (B,) left padding of the run (None: none);
    attention_mask: (B, seen + 1) or None. Returns (B, V) float32."""
    return forward(model, token, cache, pads=pads, attention_mask=attention_mask)[:, -1]


def check_teacher_forcing(n_tokens: int, prefill: int, chunk: int) -> None:
    """Validate a teacher-forcing plan: ``prefill`` in [1, n_tokens - 1], ``chunk`` >= 1."""
    check_int(
        "prefill",
        prefill,
        minimum=1,
        below=n_tokens,
        expected=f"an integer in [1, {n_tokens - 1}] (fewer than the {n_tokens} tokens, so at least one token "
        f"is scored)",
    )
    check_int("chunk", chunk, minimum=1, expected="an integer >= 1 (1 = real decode steps)")


def _one_row(token_ids: torch.Tensor, what: str = "token_ids") -> torch.Tensor:
    if not isinstance(token_ids, torch.Tensor) or token_ids.ndim != 2 or token_ids.shape[0] != 1:
        shape = tuple(token_ids.shape) if isinstance(token_ids, torch.Tensor) else type(token_ids).__name__
        raise ValueError(f"{what} must be a (1, N) integer tensor, got {shape}")
    return token_ids.long()


@torch.inference_mode()
def teacher_forced(
    model, token_ids: torch.Tensor, cache, *, prefill: int, chunk: int = 1
) -> Iterator[tuple[int, torch.Tensor]]:
    """Teacher-force ``token_ids`` (1, N) through ``cache``; yield ``(first, logits)`` chunk by chunk.

    The prefill feeds tokens ``0..P-1`` in one forward and keeps only its last logit, which predicts
    token ``P``; then tokens ``P..N-2`` go in ``chunk`` at a time. ``logits`` is ``(C, V)`` float32
    and its row ``j`` predicts token ``P + first + j``: the scored tokens are ``P..N-1``, ``n = N - P``
    of them.
    """
    ids = _one_row(token_ids).to(model.device)
    n_tokens = ids.shape[1]
    check_teacher_forcing(n_tokens, prefill, chunk)
    yield 0, forward(model, ids[:, :prefill], cache, logits_to_keep=1)[0]
    offset = prefill
    while offset < n_tokens - 1:  # the last token is only ever a target
        end = min(offset + chunk, n_tokens - 1)
        yield offset + 1 - prefill, forward(model, ids[:, offset:end], cache, logits_to_keep=0)[0]
        offset = end


@torch.inference_mode()
def greedy(
    model,
    input_ids: torch.Tensor,
    cache,
    max_new_tokens: int,
    *,
    stop_ids: Sequence[int] = (),
    follow: Sequence[int] | None = None,
    prefill_chunk: int | None = None,
) -> list[int]:
    """Greedy continuation of ``input_ids`` (1, T) through ``cache``, one decode step per token.

    Stops after ``max_new_tokens``, after emitting a token in ``stop_ids``, or — with ``follow`` (a
    reference continuation) — at the first token that differs from it (that token included), which is
    all a prefix match needs. ``prefill_chunk`` feeds the prompt in chunks of that many tokens (so a
    StreamingLLM cache evicts while reading it), else in one forward.
    """
    ids = _one_row(input_ids, "input_ids").to(model.device)
    logits = prefill(model, ids, cache, chunk_size=prefill_chunk)  # (1, V)
    out: list[int] = []
    stops = set(stop_ids)
    while len(out) < max_new_tokens:
        tok = int(logits[0].argmax())
        out.append(tok)
        if tok in stops or (follow is not None and (len(out) > len(follow) or tok != follow[len(out) - 1])):
            break
        if len(out) == max_new_tokens:
            break
        logits = decode_one_token(model, torch.tensor([[tok]], device=ids.device), cache)
    return out


# ---------------------------------------------------------------------------------------------
# sampling


def sample_next(
    logits: torch.Tensor,
    temperature: float = 0.0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Next token per row. logits: (B, V) -> (B,) int64.

    temperature 0 is greedy (argmax); otherwise softmax(logits / temperature) restricted to the
    smallest set of tokens whose probability reaches ``top_p`` (nucleus sampling, Holtzman et al.
    2019; the most likely token is always kept), drawn with ``generator``.
    """
    check_sampling(temperature, top_p)
    if temperature == 0:
        return logits.argmax(dim=-1)
    # In float64, shifted so the top logit is 0: a tiny temperature (1e-40) then sends every other
    # token to exp(-inf) = 0 (greedy in the limit) instead of inf / inf = NaN in float32.
    scaled = logits.double()  # (B, V)
    probs = torch.softmax(
        (scaled - scaled.amax(dim=-1, keepdim=True)) / temperature, dim=-1
    ).float()  # (B, V)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)  # (B, V) each
        # Drop a token when the ones more likely than it already reach top_p; the top one never is (a
        # top_p below float precision, 1e-300, keeps it alone).
        drop = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p
        drop[..., 0] = False
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def check_sampling(temperature, top_p) -> None:
    """Raise ValueError unless ``temperature >= 0`` and ``0 < top_p <= 1`` (numbers, not bools)."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature >= 0:
        raise ValueError(f"temperature must be a number >= 0 (0 = greedy), got {temperature!r}")
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")


@dataclass
class GenerationStats:
    """Counts and timings of one :func:`generate` run, updated as it goes.

    prompt_tokens: real (non-pad) prompt tokens over the batch. new_tokens: tokens generated per
    row. prefill_s: prompt forward + first token. decode_s: the decode steps (one forward each,
    ``decode_steps = new_tokens - 1``: the last token is never fed back).
    """

    batch_size: int = 1
    prompt_tokens: int = 0
    new_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0

    @property
    def decode_steps(self) -> int:
        return max(0, self.new_tokens - 1)

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else float("nan")

    @property
    def decode_tokens_per_s(self) -> float:
        """Generated tokens per second of decoding, over the batch."""
        if self.decode_s <= 0 or self.decode_steps == 0:
            return float("nan")
        return self.batch_size * self.decode_steps / self.decode_s

    def to_dict(self) -> dict:
        return dict(
            batch_size=self.batch_size,
            prompt_tokens=self.prompt_tokens,
            new_tokens=self.new_tokens,
            prefill_s=self.prefill_s,
            decode_s=self.decode_s,
            prefill_tokens_per_s=self.prefill_tokens_per_s,
            decode_tokens_per_s=self.decode_tokens_per_s,
        )


@dataclass
class TokenEvent:
    """One generated token per row. step: 0-based index of the new token; tokens: (B,) ids as
    Python ints; seconds: time this step took (for step 0: the prefill); done: every row has
    produced an end-of-sequence token (this event is the last)."""

    step: int
    tokens: list[int]
    seconds: float
    done: bool = False


class Generation:
    """An in-progress :func:`generate` run: iterate it for :class:`TokenEvent`; ``stats`` is live."""

    def __init__(self, events: Iterator[TokenEvent], stats: GenerationStats):
        self._events = events
        self.stats = stats

    def __iter__(self) -> Iterator[TokenEvent]:
        return self._events

    def __next__(self) -> TokenEvent:
        return next(self._events)

    def close(self) -> None:
        self._events.close()


def generate(
    model,
    input_ids: torch.Tensor,
    cache,
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    attention_mask: torch.Tensor | None = None,
    chunk_size: int | None = None,
    linears=None,
) -> Generation:
    """Generate up to ``max_new_tokens`` tokens per row after ``input_ids`` (B, T), through ``cache``.

    Returns a :class:`Generation`; nothing runs until it is iterated. Sampling draws from a
    ``torch.Generator`` seeded with ``seed`` (None: fresh entropy), never from the global RNG, so a
    seeded run is reproducible. A row that has produced an ``eos_token_id`` keeps emitting its
    first eos id; the run stops once every row has. Memory per step is constant: no per-step list
    is kept and the attention mask (if any) is one buffer sized for the whole run. linears: a
    :class:`kvslim.engine.linears.Linears` whose route runs the model's linear layers in the run (None: torch's).
    """
    check_int("max_new_tokens", max_new_tokens, minimum=1, expected="an integer >= 1")
    check_sampling(temperature, top_p)
    if input_ids.ndim != 2:
        raise ValueError(f"input_ids must be (batch, tokens), got shape {tuple(input_ids.shape)}")
    B = input_ids.shape[0]
    prompt_tokens = int(attention_mask.sum()) if attention_mask is not None else input_ids.numel()
    stats = GenerationStats(batch_size=B, prompt_tokens=prompt_tokens)
    eos = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id or [])
    events = _run(
        model, input_ids, cache, stats, max_new_tokens, temperature, top_p, seed, eos, attention_mask, chunk_size, linears
    )
    return Generation(events, stats)


def sampling_generator(temperature: float, seed: int | None, device) -> torch.Generator | None:
    """The generator a sampled stream draws from: None when it decodes greedily (``temperature`` 0), else seeded by
    ``seed`` (at random without one)."""
    if temperature <= 0:
        return None
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


def _run(
    model, input_ids, cache, stats, max_new_tokens, temperature, top_p, seed, eos, attention_mask, chunk_size, linears
) -> Iterator[TokenEvent]:
    device = input_ids.device
    B, T = input_ids.shape
    generator = sampling_generator(temperature, seed, device)
    eos_ids = torch.tensor(eos, dtype=torch.long, device=device) if eos else None
    mask_buf = pads = None
    if attention_mask is not None:
        # (B, T + max_new_tokens): one buffer, sliced per step instead of a growing torch.cat.
        mask_buf = torch.ones(B, T + max_new_tokens, dtype=attention_mask.dtype, device=device)
        mask_buf[:, :T] = attention_mask
        pads = left_padding(attention_mask)  # (B,)

    token = finished = None
    for step in range(max_new_tokens):
        t0 = time.perf_counter()
        # inference_mode (and the linears' route) per step, never across a yield: the caller's code between steps
        # must not run in (or be able to corrupt) this generator's autograd state, nor through its route.
        with torch.inference_mode(), (nullcontext() if linears is None else linears.routed()):
            if step == 0:
                logits = prefill(
                    model, input_ids, cache, attention_mask=attention_mask, chunk_size=chunk_size
                )  # (B, V)
                finished = torch.zeros(B, dtype=torch.bool, device=device)
            else:
                mask = None if mask_buf is None else mask_buf[:, : T + step]
                logits = decode_one_token(model, token[:, None], cache, pads=pads, attention_mask=mask)
            token = sample_next(logits, temperature, top_p, generator)  # (B,)
            if eos_ids is not None:
                token = torch.where(finished, eos_ids[0], token)
                finished |= torch.isin(token, eos_ids)
            ids = token.tolist()  # syncs the device, so the timing below is honest
            done = bool(finished.all()) if eos_ids is not None else False
        seconds = time.perf_counter() - t0
        if step == 0:
            stats.prefill_s = seconds
        else:
            stats.decode_s += seconds
        stats.new_tokens = step + 1
        yield TokenEvent(step=step, tokens=ids, seconds=seconds, done=done)
        if done:
            return
