"""Quality of a cache mode, measured through the cached path, side by side with the reference.

Every measurement feeds tokens through a real cache object exactly as decoding does: prefill, then
chunks (by default single tokens, i.e. real decode steps) with explicit position ids, the same cache
object throughout. The reference is the uncompressed, unbounded mode ``none``; it is always run in
the same call and included in the results, so every number has its baseline next to it.

- :func:`perplexity_through_cache` / :func:`compare_perplexity`: teacher-forced perplexity with its
  standard error (delta method, as mlx-lm and llama.cpp report it), KL(reference || mode) per token
  in float64 over the full vocabulary, top-1 agreement with the reference, and a per-position curve.
- :func:`greedy_prefix_match`: the seed's metric — the fraction of the reference's greedy
  continuation a mode reproduces before its first divergence.
- :func:`passkey`: a 5-digit key hidden in filler text, the model asked to repeat it.
- :func:`memory_table`: the bytes each mode holds at each length, from the codecs' real encodings.

This module knows nothing about the command line; :mod:`kvslim.cli.eval` only parses and prints.
Caches are built from specs (``parse_spec``) by ``SlimCache.from_config``; every entry point takes
an optional ``make_cache(CacheConfig) -> Cache`` to substitute another cache (tests use it).
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from .config import CacheConfig, parse_spec
from .formats import make_codec

#: The spec of the reference mode: the model's own dtype, nothing evicted.
REFERENCE = "none"
#: Store the reference's logits (n x vocab float32) up to this many bytes; beyond, run the
#: reference and the modes in lockstep, chunk by chunk (no stored logits, all caches alive at once).
MAX_REFERENCE_BYTES = 1_600_000_000

CacheMaker = Callable[[CacheConfig], object]


# --------------------------------------------------------------------------------------------
# Modes: labelled cache configs, the reference first
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Mode:
    """One cache mode of a run: the spec as the user wrote it and its validated config."""

    label: str
    config: CacheConfig


def resolve_modes(configs: Iterable[str | CacheConfig]) -> list[Mode]:
    """Parse specs (or take configs), put the reference ``none`` first, drop duplicates.

    Two specs that parse to the same config (``int4`` and ``int4,group=32``) are one mode, labelled
    as first written. Raises ValueError (from :func:`parse_spec`) naming a bad spec.
    """
    modes = [Mode(REFERENCE, parse_spec(REFERENCE))]
    for c in configs:
        if isinstance(c, CacheConfig):
            mode = Mode(c.to_spec(), c)
        elif isinstance(c, str):
            mode = Mode(c.strip(), parse_spec(c))
        else:
            raise ValueError(f"a cache mode must be a spec string or a CacheConfig, got {c!r}")
        if all(mode.config != m.config for m in modes):
            modes.append(mode)
    return modes


def slim_cache_maker(model_config) -> CacheMaker:
    """``make_cache(CacheConfig) -> SlimCache`` for a model config (imports transformers lazily)."""
    from .cache import SlimCache

    def make(cfg: CacheConfig):
        return SlimCache.from_config(cfg, config=model_config)

    return make


def _maker(model, make_cache: CacheMaker | None) -> CacheMaker:
    return make_cache if make_cache is not None else slim_cache_maker(model.config)


def _progress(total: int, desc: str, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, disable=not enabled, leave=False, unit="tok", dynamic_ncols=True)


# --------------------------------------------------------------------------------------------
# Teacher-forced logits through a cache
# --------------------------------------------------------------------------------------------
def check_ppl_args(n_tokens: int, prefill: int, chunk: int) -> None:
    """Raise ValueError unless ``1 <= prefill < n_tokens`` and ``chunk >= 1``."""
    if isinstance(prefill, bool) or not isinstance(prefill, int) or not 1 <= prefill < n_tokens:
        raise ValueError(
            f"prefill must be an integer in [1, {n_tokens - 1}] (fewer than the {n_tokens} tokens, so at least "
            f"one token is scored), got {prefill!r}"
        )
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk must be an integer >= 1 (1 = real decode steps), got {chunk!r}")


def _as_ids(token_ids: torch.Tensor) -> torch.Tensor:
    if not isinstance(token_ids, torch.Tensor) or token_ids.ndim != 2 or token_ids.shape[0] != 1:
        shape = tuple(token_ids.shape) if isinstance(token_ids, torch.Tensor) else type(token_ids).__name__
        raise ValueError(f"token_ids must be a (1, N) integer tensor, got {shape}")
    return token_ids.long()


@torch.inference_mode()
def iter_cached_logits(
    model, token_ids: torch.Tensor, cache, *, prefill: int, chunk: int = 1
) -> Iterator[tuple[int, torch.Tensor]]:
    """Teacher-force ``token_ids`` (1, N) through ``cache``; yield ``(first, logits)`` chunk by chunk.

    The prefill feeds tokens ``0..P-1`` in one forward and keeps only its last logit, which predicts
    token ``P``; then tokens ``P..N-2`` go in ``chunk`` at a time with position ids
    ``arange(offset, offset + C)``. ``logits`` is ``(C, V)`` float32 and its row ``j`` predicts
    token ``P + first + j``: the scored tokens are ``P..N-1``, ``n = N - P`` of them.
    """
    ids = _as_ids(token_ids).to(model.device)
    n_tokens = ids.shape[1]
    check_ppl_args(n_tokens, prefill, chunk)

    def forward(lo: int, hi: int, keep: int) -> torch.Tensor:
        pos = torch.arange(lo, hi, device=ids.device)[None]  # (1, C)
        out = model(ids[:, lo:hi], cache=cache, use_cache=True, position_ids=pos, logits_to_keep=keep)
        return out.logits[0].float()  # (keep or C, V)

    yield 0, forward(0, prefill, 1)
    offset = prefill
    while offset < n_tokens - 1:  # the last token is only ever a target
        end = min(offset + chunk, n_tokens - 1)
        yield offset + 1 - prefill, forward(offset, end, 0)
        offset = end


def _log_softmax64(logits: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.double(), dim=-1)


class _Scorer:
    """Accumulates per-token NLL, and KL / top-1 against reference logits, chunk by chunk."""

    def __init__(self, targets: torch.Tensor, with_reference: bool):
        n = targets.shape[0]
        self.targets = targets  # (n,) the scored tokens
        self.nll = torch.empty(n, dtype=torch.float64)
        self.kld = torch.empty(n, dtype=torch.float64) if with_reference else None
        self.agree = torch.empty(n, dtype=torch.bool) if with_reference else None

    def add(self, first: int, logits: torch.Tensor, ref_logits: torch.Tensor | None = None) -> None:
        """logits, ref_logits: (C, V) predicting scored tokens ``first .. first + C - 1``."""
        c = logits.shape[0]
        sl = slice(first, first + c)
        logp = _log_softmax64(logits)  # (C, V) float64
        tgt = self.targets[sl].to(logp.device)
        self.nll[sl] = -logp.gather(1, tgt[:, None])[:, 0].cpu()
        if self.kld is not None:
            if ref_logits is None:
                raise ValueError("reference logits are required for every chunk once a reference is given")
            ref = ref_logits.to(logp.device)
            ref_logp = _log_softmax64(ref)
            # KL(ref || mode) = sum_v p_ref (log p_ref - log p_mode); exactly 0 for identical logits.
            # Mathematically >= 0; clamp the float64 rounding of near-identical distributions.
            kl = (ref_logp.exp() * (ref_logp - logp)).sum(-1).clamp_min(0.0)
            self.kld[sl] = kl.cpu()
            self.agree[sl] = (logits.argmax(-1) == ref.argmax(-1)).cpu()


# --------------------------------------------------------------------------------------------
# Perplexity results
# --------------------------------------------------------------------------------------------
@dataclass
class PerplexityResult:
    """Per-token measurements of one mode on scored tokens ``prefill .. tokens - 1``.

    nll: (n,) float64 negative log-likelihood of each scored token.
    kld: (n,) float64 KL(reference || mode) of each next-token distribution, or None without a reference.
    agree: (n,) bool, the mode's argmax equals the reference's, or None without a reference.
    """

    config: str
    tokens: int
    prefill: int
    chunk: int
    nll: torch.Tensor
    kld: torch.Tensor | None = None
    agree: torch.Tensor | None = None

    @property
    def n_scored(self) -> int:
        return int(self.nll.shape[0])

    @property
    def ppl(self) -> float:
        return math.exp(float(self.nll.mean()))

    @property
    def ppl_stderr(self) -> float:
        """Delta method: ``ppl * std(nll) / sqrt(n)`` (sample std; nan for a single token)."""
        n = self.n_scored
        if n < 2:
            return float("nan")
        return self.ppl * float(self.nll.std(unbiased=True)) / math.sqrt(n)

    @property
    def kld_mean(self) -> float:
        return float("nan") if self.kld is None else float(self.kld.mean())

    @property
    def kld_p99(self) -> float:
        return float("nan") if self.kld is None else float(torch.quantile(self.kld, 0.99))

    @property
    def kld_max(self) -> float:
        return float("nan") if self.kld is None else float(self.kld.max())

    @property
    def top1(self) -> float:
        return float("nan") if self.agree is None else float(self.agree.double().mean())

    def curve(self, bucket: int = 256) -> list[dict]:
        """Perplexity (and mean KL) per bucket of token positions ``[k*bucket, (k+1)*bucket)``.

        Positions are those of the predicted tokens in the text, so with StreamingLLM the curve shows
        where eviction starts to cost. Buckets are clipped to the scored range.
        """
        if isinstance(bucket, bool) or not isinstance(bucket, int) or bucket < 1:
            raise ValueError(f"bucket must be an integer >= 1 (tokens per curve point), got {bucket!r}")
        out = []
        start = self.prefill
        while start < self.tokens:
            end = min((start // bucket + 1) * bucket, self.tokens)
            sl = slice(start - self.prefill, end - self.prefill)
            point = {"start": start, "end": end, "ppl": math.exp(float(self.nll[sl].mean()))}
            if self.kld is not None:
                point["kld_mean"] = float(self.kld[sl].mean())
            out.append(point)
            start = end
        return out

    def summary(self, reference_ppl: float | None = None, bucket: int = 256) -> dict:
        """The JSON record: config, ppl, ppl_stderr, kld_mean, kld_p99, kld_max, top1, ppl_ratio, curve."""
        return {
            "config": self.config,
            "ppl": self.ppl,
            "ppl_stderr": self.ppl_stderr,
            "kld_mean": self.kld_mean,
            "kld_p99": self.kld_p99,
            "kld_max": self.kld_max,
            "top1": self.top1,
            "ppl_ratio": float("nan") if reference_ppl is None else self.ppl / reference_ppl,
            "scored_tokens": self.n_scored,
            "curve": self.curve(bucket),
        }


def perplexity_through_cache(
    model,
    token_ids: torch.Tensor,
    cache_factory: Callable[[], object],
    *,
    prefill: int,
    chunk: int = 1,
    reference_logits: torch.Tensor | None = None,
    keep_logits: bool = False,
    progress: bool = True,
    label: str = "",
) -> PerplexityResult | tuple[PerplexityResult, torch.Tensor]:
    """Teacher-forced perplexity of ``token_ids`` (1, N) through one fresh ``cache_factory()``.

    Scores tokens ``prefill .. N-1`` (see :func:`iter_cached_logits`). With ``reference_logits``
    ``(N - prefill, V)`` — the reference's raw next-token logits for the same tokens, e.g. from
    ``keep_logits=True`` — also KL(reference || this) per token in float64 over the full vocabulary
    and top-1 agreement. With ``keep_logits`` returns ``(result, logits)``, ``logits`` being
    ``(N - prefill, V)`` float32 (``4 * n * V`` bytes).
    """
    ids = _as_ids(token_ids)
    n_tokens = ids.shape[1]
    check_ppl_args(n_tokens, prefill, chunk)
    n = n_tokens - prefill
    if reference_logits is not None and reference_logits.shape[0] != n:
        raise ValueError(
            f"reference_logits must have one row per scored token ({n} = {n_tokens} tokens - prefill {prefill}), "
            f"got shape {tuple(reference_logits.shape)}"
        )
    scorer = _Scorer(ids[0, prefill:].cpu(), with_reference=reference_logits is not None)
    kept = None
    with _progress(n, label or "ppl", progress) as bar:
        for first, logits in iter_cached_logits(model, ids, cache_factory(), prefill=prefill, chunk=chunk):
            c = logits.shape[0]
            ref = None if reference_logits is None else reference_logits[first : first + c]
            scorer.add(first, logits, ref)
            if keep_logits:
                if kept is None:
                    kept = torch.empty(n, logits.shape[1], dtype=torch.float32)
                kept[first : first + c] = logits.cpu()
            bar.update(c)
    result = PerplexityResult(label, n_tokens, prefill, chunk, scorer.nll, scorer.kld, scorer.agree)
    return (result, kept) if keep_logits else result


def full_forward_nll(model, token_ids: torch.Tensor, *, prefill: int) -> torch.Tensor:
    """NLL (float64) of tokens ``prefill .. N-1`` from one plain forward over the whole sequence, no cache.

    The ground truth the cached path must reproduce for the reference mode. Returns (N - prefill,).
    """
    ids = _as_ids(token_ids).to(model.device)
    check_ppl_args(ids.shape[1], prefill, 1)
    with torch.inference_mode():
        logits = model(ids, use_cache=False).logits[0, prefill - 1 : -1]  # (n, V)
    logp = _log_softmax64(logits.float())
    return -logp.gather(1, ids[0, prefill:, None])[:, 0].cpu()


@dataclass
class PerplexityReport:
    """The results of :func:`compare_perplexity`, the reference first."""

    results: list[PerplexityResult]

    @property
    def reference(self) -> PerplexityResult:
        return self.results[0]

    def records(self, bucket: int = 256) -> list[dict]:
        """One JSON record per mode (see :meth:`PerplexityResult.summary`), the reference first."""
        ref = self.reference.ppl
        return [r.summary(ref, bucket) for r in self.results]


def compare_perplexity(
    model,
    token_ids: torch.Tensor,
    configs: Iterable[str | CacheConfig],
    *,
    prefill: int,
    chunk: int = 1,
    progress: bool = True,
    make_cache: CacheMaker | None = None,
    max_reference_bytes: int = MAX_REFERENCE_BYTES,
) -> PerplexityReport:
    """Perplexity, KL, top-1 of every mode and of the reference ``none``, in one run.

    When the reference's logits fit in ``max_reference_bytes`` (``4 * n * V``; 805 MB for
    n = 4096 and SmolLM2's 49152 tokens), the reference runs first and its logits are kept; each mode
    then runs alone, so only one cache is alive at a time. Otherwise every mode advances in lockstep
    with the reference, chunk by chunk, and KL is computed on the fly: no logits are stored, but all
    caches are alive together. Both give the same numbers.
    """
    modes = resolve_modes(configs)
    make = _maker(model, make_cache)
    ids = _as_ids(token_ids)
    n_tokens = ids.shape[1]
    check_ppl_args(n_tokens, prefill, chunk)
    n = n_tokens - prefill
    vocab = model.config.vocab_size
    if 4 * n * vocab <= max_reference_bytes:
        ref, ref_logits = perplexity_through_cache(
            model,
            ids,
            lambda: make(modes[0].config),
            prefill=prefill,
            chunk=chunk,
            keep_logits=True,
            progress=progress,
            label=modes[0].label,
        )
        ref.kld = torch.zeros(n, dtype=torch.float64)
        ref.agree = torch.ones(n, dtype=torch.bool)
        results = [ref]
        for m in modes[1:]:
            results.append(
                perplexity_through_cache(
                    model,
                    ids,
                    lambda m=m: make(m.config),
                    prefill=prefill,
                    chunk=chunk,
                    reference_logits=ref_logits,
                    progress=progress,
                    label=m.label,
                )
            )
        return PerplexityReport(results)
    return PerplexityReport(
        _lockstep(model, ids, modes, make, prefill=prefill, chunk=chunk, progress=progress)
    )


def _lockstep(model, ids, modes, make, *, prefill, chunk, progress) -> list[PerplexityResult]:
    n_tokens = ids.shape[1]
    n = n_tokens - prefill
    targets = ids[0, prefill:].cpu()
    gens = [iter_cached_logits(model, ids, make(m.config), prefill=prefill, chunk=chunk) for m in modes]
    scorers = [_Scorer(targets, with_reference=True) for _ in modes]
    with _progress(n, f"ppl ({len(modes)} modes in lockstep)", progress) as bar:
        for outs in zip(*gens):
            first, ref_logits = outs[0]
            for scorer, (_, logits) in zip(scorers, outs):
                scorer.add(first, logits, ref_logits)
            bar.update(ref_logits.shape[0])
    return [
        PerplexityResult(m.label, n_tokens, prefill, chunk, s.nll, s.kld, s.agree)
        for m, s in zip(modes, scorers)
    ]


def plot_ppl_curves(report: PerplexityReport, path: str, *, bucket: int = 256, title: str = "") -> None:
    """Write a PNG: perplexity (top) and mean KL to the reference (bottom, log scale) per bucket of
    positions, one line per mode (needs matplotlib).

    Uses matplotlib's object API with the Agg canvas: no global backend switch.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError("plotting needs matplotlib: pip install 'kvslim[plot]'") from None
    fig = Figure(figsize=(8, 7), dpi=120)
    FigureCanvasAgg(fig)
    ax_ppl, ax_kl = fig.subplots(2, 1, sharex=True)
    for i, r in enumerate(report.results):
        pts = r.curve(bucket)
        xs = [(p["start"] + p["end"]) / 2 for p in pts]
        width = 2.0 if r is report.reference else 1.2
        style = dict(marker="o", markersize=3, label=r.config, linewidth=width, color=f"C{i % 10}")
        ax_ppl.plot(xs, [p["ppl"] for p in pts], **style)
        kl = [p.get("kld_mean", 0.0) for p in pts]
        if any(k > 0 for k in kl):  # log axis: the reference (KL 0) has no line there
            ax_kl.plot(xs, [k if k > 0 else float("nan") for k in kl], **style)
    ax_ppl.set_ylabel("perplexity")
    ax_ppl.set_title(title or "through the cache, per position")
    ax_kl.set_yscale("log")
    ax_kl.set_ylabel("mean KL(reference || mode)")
    ax_kl.set_xlabel(f"token position (buckets of {bucket})")
    for ax in (ax_ppl, ax_kl):
        ax.grid(alpha=0.3)
    ax_ppl.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)


# --------------------------------------------------------------------------------------------
# Greedy decoding through a cache
# --------------------------------------------------------------------------------------------
@torch.inference_mode()
def greedy_through_cache(
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
    ids = _as_ids(input_ids).to(model.device)
    t = ids.shape[1]
    step = prefill_chunk or t
    logits = None
    for lo in range(0, t, step):
        hi = min(lo + step, t)
        pos = torch.arange(lo, hi, device=ids.device)[None]
        logits = model(ids[:, lo:hi], cache=cache, use_cache=True, position_ids=pos, logits_to_keep=1).logits
    out: list[int] = []
    stops = set(stop_ids)
    while len(out) < max_new_tokens:
        tok = int(logits[0, -1].argmax())
        out.append(tok)
        if tok in stops or (follow is not None and (len(out) > len(follow) or tok != follow[len(out) - 1])):
            break
        if len(out) == max_new_tokens:
            break
        pos = torch.tensor([[t + len(out) - 1]], device=ids.device)
        logits = model(
            torch.tensor([[tok]], device=ids.device), cache=cache, use_cache=True, position_ids=pos
        ).logits
    return out


@dataclass(frozen=True)
class Prompt:
    """A greedy-match prompt. ``chat`` wraps ``text`` in the tokenizer's chat template (if it has one)."""

    name: str
    text: str
    chat: bool = False


BUILTIN_PROMPTS: tuple[Prompt, ...] = (
    Prompt("story", "Once upon a time, in a small village at the edge of a dark forest, there lived an old"),
    Prompt("code", 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'),
    Prompt("list", "Ten things to pack for a week-long camping trip:\n1."),
    Prompt(
        "math",
        "Question: A baker makes 24 muffins in the morning and 36 in the afternoon. She sells 45 of them "
        "and gives 5 to her neighbour. How many muffins are left?\nAnswer: Let's think step by step.",
    ),
    Prompt(
        "factual", "The water cycle describes how water moves on, above and below the surface of the Earth."
    ),
    Prompt("chat", "Explain in a few sentences why the sky is blue.", chat=True),
    Prompt("chat-howto", "Give me three tips for writing clear documentation.", chat=True),
)


def load_prompts(path: str) -> list[Prompt]:
    """Prompts from a file: one per non-empty line (``\\n`` escapes a newline inside a prompt).

    A line starting with ``chat:`` is wrapped in the chat template.
    """
    out = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            line = line.rstrip("\n")
            if not line.strip():
                continue
            chat = line.startswith("chat:")
            text = (line[5:].lstrip() if chat else line).replace("\\n", "\n")
            out.append(Prompt(f"line{i}", text, chat))
    if not out:
        raise ValueError(f"prompts file {path!r} has no prompts (one per non-empty line)")
    return out


def encode_prompt(tokenizer, prompt: Prompt | str | Sequence[int] | torch.Tensor) -> torch.Tensor:
    """A prompt as ``(1, T)`` token ids: token ids pass through, text is tokenized (chat-templated
    when ``prompt.chat`` and the tokenizer has a template)."""
    if isinstance(prompt, torch.Tensor):
        return prompt.reshape(1, -1).long()
    if not isinstance(prompt, (str, Prompt)):
        return torch.tensor([list(prompt)], dtype=torch.long)
    if tokenizer is None:
        raise ValueError("text prompts need a tokenizer; pass token ids to run without one")
    if isinstance(prompt, str):
        prompt = Prompt("prompt", prompt)
    if prompt.chat and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt.text}], tokenize=False, add_generation_prompt=True
        )
        return tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
    return tokenizer(prompt.text, return_tensors="pt").input_ids


def _stop_ids(tokenizer) -> list[int]:
    eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    if eos is None:
        return []
    return list(eos) if isinstance(eos, (list, tuple)) else [int(eos)]


@dataclass
class PromptMatch:
    """One prompt's prefix match: ``matched`` of the reference's ``reference_tokens`` before divergence
    (``prompt_tokens``: the prompt's length)."""

    name: str
    matched: int
    reference_tokens: int
    prompt_tokens: int = 0

    @property
    def prefix_match(self) -> float:
        return self.matched / self.reference_tokens if self.reference_tokens else 1.0


@dataclass
class GreedyResult:
    config: str
    prompts: list[PromptMatch] = field(default_factory=list)

    @property
    def prefix_match_mean(self) -> float:
        return sum(p.prefix_match for p in self.prompts) / len(self.prompts) if self.prompts else float("nan")

    def summary(self) -> dict:
        return {
            "config": self.config,
            "prefix_match_mean": self.prefix_match_mean,
            "prompts": [
                {
                    "name": p.name,
                    "prefix_match": p.prefix_match,
                    "matched": p.matched,
                    "reference_tokens": p.reference_tokens,
                    "prompt_tokens": p.prompt_tokens,
                }
                for p in self.prompts
            ],
        }


@dataclass
class GreedyReport:
    results: list[GreedyResult]
    #: The reference's greedy continuation of each prompt (token ids).
    reference_tokens: list[list[int]]

    def records(self) -> list[dict]:
        return [r.summary() for r in self.results]


def greedy_prefix_match(
    model,
    tokenizer,
    prompts: Sequence[Prompt | str | Sequence[int]] | None = None,
    configs: Iterable[str | CacheConfig] = (),
    *,
    tokens: int = 64,
    progress: bool = True,
    make_cache: CacheMaker | None = None,
) -> GreedyReport:
    """Greedy prefix match of each mode against the reference's greedy continuation (the seed's metric).

    For each prompt the reference ``none`` decodes up to ``tokens`` tokens (stopping after EOS); each
    mode decodes greedily through its own cache and scores the fraction of the reference's tokens it
    reproduces before its first divergence. ``prompts`` defaults to :data:`BUILTIN_PROMPTS`.
    """
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise ValueError(f"tokens must be an integer >= 1 (tokens generated per prompt), got {tokens!r}")
    prompts = list(BUILTIN_PROMPTS if prompts is None else prompts)
    if not prompts:
        raise ValueError("no prompts given")
    modes = resolve_modes(configs)
    make = _maker(model, make_cache)
    stops = _stop_ids(tokenizer)
    encoded = [encode_prompt(tokenizer, p) for p in prompts]
    names = [p.name if isinstance(p, Prompt) else f"prompt{i}" for i, p in enumerate(prompts)]
    results = [GreedyResult(m.label) for m in modes]
    refs: list[list[int]] = []
    with _progress(len(prompts) * len(modes), "greedy", progress) as bar:
        bar.unit = "run"
        for name, ids in zip(names, encoded):
            ref = greedy_through_cache(model, ids, make(modes[0].config), tokens, stop_ids=stops)
            refs.append(ref)
            results[0].prompts.append(PromptMatch(name, len(ref), len(ref), ids.shape[1]))
            bar.update(1)
            for m, res in zip(modes[1:], results[1:]):
                out = greedy_through_cache(model, ids, make(m.config), len(ref), stop_ids=stops, follow=ref)
                matched = next(
                    (i for i, (a, b) in enumerate(zip(out, ref)) if a != b), min(len(out), len(ref))
                )
                res.prompts.append(PromptMatch(name, matched, len(ref), ids.shape[1]))
                bar.update(1)
    return GreedyReport(results, refs)


# --------------------------------------------------------------------------------------------
# Passkey retrieval
# --------------------------------------------------------------------------------------------
PASSKEY_INTRO = (
    "There is an important piece of information hidden inside a lot of irrelevant text. Find it and "
    "memorize it. I will quiz you about it."
)
PASSKEY_FILLER = (
    " The grass is green.",
    " The sky is blue.",
    " The sun is yellow.",
    " Here we go.",
    " There and back again.",
)
PASSKEY_NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key."
PASSKEY_QUESTION = " What is the pass key?"
PASSKEY_ANSWER = "The pass key is"
_PLACEHOLDER = "\x00HAYSTACK\x00"


@dataclass(frozen=True)
class PasskeyPrompt:
    """One haystack: ``ids`` (1, T) with the 5-digit ``key`` at relative ``depth`` (0 = start, 1 = end)."""

    ids: torch.Tensor
    key: str
    depth: float
    key_position: int


def _tok(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False).input_ids


def build_passkey_prompt(tokenizer, length: int, depth: float, key: str) -> PasskeyPrompt:
    """A prompt of at most ``length`` tokens: intro, filler sentences with the key at ``depth``, question.

    Assembled from separately tokenized pieces so its length is exact; with a chat template the
    haystack is the user turn and the assistant turn starts with "The pass key is".
    """
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1] (0 = start of the haystack, 1 = end), got {depth!r}")
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": _PLACEHOLDER}], tokenize=False, add_generation_prompt=True
        )
        before, after = text.split(_PLACEHOLDER)
        head = _tok(tokenizer, before + PASSKEY_INTRO)
        tail = _tok(tokenizer, PASSKEY_QUESTION) + _tok(tokenizer, after + PASSKEY_ANSWER)
    else:
        head = tokenizer(PASSKEY_INTRO).input_ids
        tail = _tok(tokenizer, PASSKEY_QUESTION + " " + PASSKEY_ANSWER)
    needle = _tok(tokenizer, PASSKEY_NEEDLE.format(key=key))
    filler = [_tok(tokenizer, s) for s in PASSKEY_FILLER]
    budget = length - len(head) - len(tail) - len(needle)
    sentences: list[list[int]] = []
    while budget >= len(filler[len(sentences) % len(filler)]):
        s = filler[len(sentences) % len(filler)]
        sentences.append(s)
        budget -= len(s)
    if not sentences:
        raise ValueError(
            f"length {length} is too short for a passkey prompt: the intro, key and question alone take "
            f"{len(head) + len(tail) + len(needle)} tokens"
        )
    cut = round(depth * len(sentences))
    before_ids = [t for s in sentences[:cut] for t in s]
    after_ids = [t for s in sentences[cut:] for t in s]
    ids = head + before_ids + needle + after_ids + tail
    return PasskeyPrompt(torch.tensor([ids]), key, depth, len(head) + len(before_ids))


@dataclass
class PasskeyCell:
    """Accuracy of one mode at one (length, depth): ``correct`` of ``trials``; ``tokens`` the real prompt length."""

    length: int
    depth: float
    tokens: int
    correct: int
    trials: int
    answers: list[str] = field(default_factory=list)

    @property
    def accuracy(self) -> float:
        return self.correct / self.trials if self.trials else float("nan")


@dataclass
class PasskeyResult:
    config: str
    cells: list[PasskeyCell] = field(default_factory=list)

    @property
    def accuracy(self) -> float:
        total = sum(c.trials for c in self.cells)
        return sum(c.correct for c in self.cells) / total if total else float("nan")

    def summary(self) -> dict:
        return {
            "config": self.config,
            "accuracy": self.accuracy,
            "cells": [
                {
                    "length": c.length,
                    "depth": c.depth,
                    "tokens": c.tokens,
                    "accuracy": c.accuracy,
                    "correct": c.correct,
                    "trials": c.trials,
                }
                for c in self.cells
            ],
        }


@dataclass
class PasskeyReport:
    results: list[PasskeyResult]

    def records(self) -> list[dict]:
        return [r.summary() for r in self.results]


def passkey_answer_correct(answer: str, key: str) -> bool:
    """The first number in the answer is the key."""
    digits = re.findall(r"\d+", answer)
    return bool(digits) and digits[0] == key


def passkey(
    model,
    tokenizer,
    configs: Iterable[str | CacheConfig] = (),
    lengths: Sequence[int] = (1024,),
    depths: Sequence[float] = (0.1, 0.5, 0.9),
    trials: int = 3,
    *,
    seed: int = 0,
    chunk: int = 64,
    answer_tokens: int = 8,
    progress: bool = True,
    make_cache: CacheMaker | None = None,
) -> PasskeyReport:
    """Passkey retrieval accuracy per mode, length and depth.

    Each trial draws a random 5-digit key (``random.Random(seed)``; the same prompts for every mode),
    hides it in filler text at the given relative depth, and greedy-decodes ``answer_tokens`` tokens;
    correct when the first number in the answer is the key. The prompt is fed ``chunk`` tokens at a
    time, so a StreamingLLM cache evicts while reading — as it would while streaming — and a key that
    falls out of the window is honestly lost (a one-shot prefill would let the question attend to it).
    """
    if isinstance(trials, bool) or not isinstance(trials, int) or trials < 1:
        raise ValueError(f"trials must be an integer >= 1, got {trials!r}")
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk must be an integer >= 1 (prompt tokens per forward), got {chunk!r}")
    modes = resolve_modes(configs)
    make = _maker(model, make_cache)
    rng = random.Random(seed)
    grid = [
        (length, depth, build_passkey_prompt(tokenizer, length, depth, str(rng.randint(10000, 99999))))
        for length in lengths
        for depth in depths
        for _ in range(trials)
    ]
    results = [PasskeyResult(m.label) for m in modes]
    with _progress(len(grid) * len(modes), "passkey", progress) as bar:
        bar.unit = "run"
        for res, m in zip(results, modes):
            cells: dict[tuple[int, float], PasskeyCell] = {}
            for length, depth, p in grid:
                out = greedy_through_cache(model, p.ids, make(m.config), answer_tokens, prefill_chunk=chunk)
                answer = tokenizer.decode(out, skip_special_tokens=True)
                cell = cells.setdefault((length, depth), PasskeyCell(length, depth, p.ids.shape[1], 0, 0))
                cell.trials += 1
                cell.correct += passkey_answer_correct(answer, p.key)
                cell.answers.append(answer)
                bar.update(1)
            res.cells = list(cells.values())
    return PasskeyReport(results)


# --------------------------------------------------------------------------------------------
# Memory: the bytes each mode holds
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelShape:
    """What the cache size depends on: layers, KV heads, head_dim, and the cache's full-precision dtype."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float32

    @classmethod
    def from_config(cls, model_config, dtype: torch.dtype = torch.float32) -> ModelShape:
        layers = model_config.num_hidden_layers
        heads = model_config.num_attention_heads
        kv_heads = getattr(model_config, "num_key_value_heads", None) or heads
        head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // heads
        return cls(int(layers), int(kv_heads), int(head_dim), dtype)

    @property
    def dtype_bytes(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    def full_cache_bytes(self, tokens: int, element_bytes: int, batch: int = 1) -> int:
        """An uncompressed cache of ``tokens`` tokens at ``element_bytes`` per element (2 for fp16)."""
        return 2 * self.layers * batch * self.kv_heads * self.head_dim * tokens * element_bytes


def _codec_costs(codec, shape: ModelShape) -> tuple[float, int]:
    """(bytes per token, bytes per token group) of one stream of one layer, batch 1, from a real encoding."""
    g = codec.token_group
    x = torch.randn(1, shape.kv_heads, g, shape.head_dim, generator=torch.Generator().manual_seed(0)).to(
        shape.dtype
    )
    enc = codec.encode(x)
    tok = sum(t.numel() * t.element_size() for t in enc.token.values())
    grp = sum(t.numel() * t.element_size() for t in enc.group.values())
    return tok / g, grp


def stream_layout(
    seen: int,
    *,
    lossy: bool,
    residual: int,
    unit: int,
    group: int = 1,
    window: int | None = None,
    prefill: int = 0,
) -> tuple[int, int, int]:
    """``(encoded tokens, encoded groups, full-precision tokens)`` one K or V stream holds after
    ``seen`` non-sink tokens arrived — the accounting of :class:`kvslim.layer.Stream`.

    The newest ``residual`` tokens stay at full precision; older ones leave the residual ``unit``
    (the config's ``group_size``) at a time and are encoded (so ``residual + (seen - residual) % unit``
    stay at full precision). ``group`` is the codec's token group: how many encoded tokens share one
    entry of its per-group parts (KIVI's per-channel K scales; 1 for per-token formats).
    StreamingLLM drops the oldest: encoded tokens one at a time, a group's shared part with its last
    token.

    With ``window >= residual + unit - 1`` (or no window) the layout does not depend on how the
    tokens were chunked. With a smaller window, single tokens never fill a unit before they leave,
    so the stream is all full precision — except what a first chunk of ``prefill`` (> 1) stream
    tokens encoded at once, which drains as the window moves on.
    """
    if not lossy:
        return 0, 0, seen if window is None else min(seen, window)
    if window is None or window >= residual + unit - 1:
        encoded = max(0, (seen - residual) // unit) * unit
        evicted = 0 if window is None else max(0, seen - window)
        return encoded - evicted, encoded // group - evicted // group, seen - encoded
    p = min(prefill, seen)
    encoded = max(0, (p - residual) // unit) * unit  # the prefill's one encode
    fp = p - encoded
    evicted = max(0, p - window)
    from_body = min(evicted, encoded)
    fp -= evicted - from_body
    body = encoded - from_body
    steps = seen - p  # then one token at a time: nothing more is encoded, the oldest leave first
    evicted = max(0, body + fp + steps - window)
    gone = min(evicted, body)
    body -= gone
    fp += steps - (evicted - gone)
    from_body += gone
    return body, encoded // group - from_body // group, fp


@dataclass(frozen=True)
class MemoryRow:
    """The bytes of one mode after ``seen`` tokens; ``stored`` tokens are held (sinks + window at most)."""

    config: str
    seen: int
    stored: int
    bytes: int
    fp16_full_bytes: int
    fp32_full_bytes: int

    @property
    def bytes_per_token(self) -> float:
        """Bytes per stored token (all layers, K and V, metadata included)."""
        return self.bytes / self.stored if self.stored else float("nan")

    @property
    def ratio_fp16(self) -> float:
        """How many times smaller than an fp16 cache holding every token seen."""
        return self.fp16_full_bytes / self.bytes if self.bytes else float("nan")

    @property
    def ratio_fp32(self) -> float:
        return self.fp32_full_bytes / self.bytes if self.bytes else float("nan")


def cache_bytes(
    shape: ModelShape, config: CacheConfig, seen: int, *, prefill: int | None = None, batch: int = 1
) -> tuple[int, int]:
    """``(stored tokens, bytes)`` a SlimCache of ``config`` holds after ``seen`` tokens: a first forward
    of ``prefill`` tokens (None: every token on its own), then one token per step.

    Mirrors :class:`kvslim.layer.SlimLayer`: per layer, sinks in the model dtype, then per stream
    encoded tokens (token parts per token, group parts per group, as the codec really encodes them)
    and a full-precision residual, plus a float32 ``(H_kv, D)`` mean-centering bias. Counts the stored
    tensors only, not the buffers' preallocated slack (see ``SlimCache.nbytes``).
    """
    if isinstance(seen, bool) or not isinstance(seen, int) or seen < 0:
        raise ValueError(f"seen must be an integer >= 0 (tokens fed to the cache), got {seen!r}")
    bounded = config.window is not None
    n_sink = min(seen, config.sink) if bounded else 0
    arrived = seen - n_sink
    first = 1 if prefill is None else max(1, min(prefill, seen))
    first_stream = first - (min(first, config.sink) if bounded else 0)
    per_elem_fp = batch * shape.kv_heads * shape.head_dim * shape.dtype_bytes  # one token, one stream
    total = 2 * n_sink * per_elem_fp
    stream_len = 0
    for role, fmt in (("k", config.k_format), ("v", config.v_format)):
        codec = make_codec(fmt, role, group_size=config.group_size, v_group_size=config.v_group_size)
        codec.check_head_dim(shape.head_dim)
        tok_bytes, grp_bytes = _codec_costs(codec, shape)
        body, groups, fp = stream_layout(
            arrived,
            lossy=codec.lossy,
            residual=config.residual,
            unit=config.group_size,
            group=codec.token_group,
            window=config.window,
            prefill=first_stream,
        )
        total += round(batch * (body * tok_bytes + groups * grp_bytes)) + fp * per_elem_fp
        stream_len = body + fp
    if config.mean_center is not None:
        total += shape.kv_heads * shape.head_dim * 4
    return n_sink + stream_len, shape.layers * total


def memory_table(
    model_config,
    configs: Iterable[str | CacheConfig],
    lengths: Sequence[int] = (1024, 4096, 32768, 131072),
    *,
    dtype: torch.dtype = torch.float32,
    prefill: int | None = None,
    batch: int = 1,
) -> list[MemoryRow]:
    """Bytes of every mode (the reference ``none`` first) at every length, for a model's real shapes.

    ``model_config`` is a transformers config (or a :class:`ModelShape`); ``dtype`` is the dtype the
    model runs in (what ``none``, sinks and residuals are stored in); ``prefill`` the tokens of the
    first forward (None: one token at a time; it matters only for windows shorter than
    ``residual + group - 1``). See :func:`cache_bytes`.
    """
    shape = (
        model_config if isinstance(model_config, ModelShape) else ModelShape.from_config(model_config, dtype)
    )
    rows = []
    for m in resolve_modes(configs):
        for length in lengths:
            stored, nbytes = cache_bytes(shape, m.config, length, prefill=prefill, batch=batch)
            rows.append(
                MemoryRow(
                    m.label,
                    length,
                    stored,
                    nbytes,
                    shape.full_cache_bytes(length, 2, batch),
                    shape.full_cache_bytes(length, 4, batch),
                )
            )
    return rows


def memory_records(rows: Sequence[MemoryRow]) -> list[dict]:
    """Group rows by mode into JSON records: config, lengths, bytes, stored_tokens, ratios (aligned lists)."""
    out: dict[str, dict] = {}
    for r in rows:
        rec = out.setdefault(
            r.config,
            {
                "config": r.config,
                "lengths": [],
                "bytes": [],
                "stored_tokens": [],
                "bytes_per_token": [],
                "ratio_fp16": [],
                "ratio_fp32": [],
            },
        )
        rec["lengths"].append(r.seen)
        rec["bytes"].append(r.bytes)
        rec["stored_tokens"].append(r.stored)
        rec["bytes_per_token"].append(r.bytes_per_token)
        rec["ratio_fp16"].append(r.ratio_fp16)
        rec["ratio_fp32"].append(r.ratio_fp32)
    return list(out.values())
