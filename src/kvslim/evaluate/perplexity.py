"""Teacher-forced perplexity through a cache, side by side with the reference.

Tokens go through a real cache object exactly as decoding feeds them — a prefill, then chunks (by
default single tokens, i.e. real decode steps) — by :func:`kvslim.generate.teacher_forced`, which
owns the forwards and the positions. This module only scores the logits it yields:

- :func:`perplexity_through_cache`: one mode's perplexity with its standard error (delta method, as
  mlx-lm and llama.cpp report it) and, given the reference's logits, KL(reference || mode) per token
  in float64 over the full vocabulary and top-1 agreement; and the bits per stored K/V element of the
  cache the text went through, read once it has seen every fed token (:func:`.memory.kv_bits`);
- :func:`compare_perplexity`: every mode and the reference ``none`` in one run, either against the
  stored reference logits or, when those would not fit, in lockstep;
- :func:`full_forward_nll`: the no-cache ground truth the reference mode must reproduce.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from ..config import CacheConfig
from ..generate import _one_row, check_teacher_forcing, teacher_forced
from .memory import KVBits, kv_bits
from .modes import CacheMaker, Mode, cache_maker, check_int, progress_bar, resolve_modes

#: Store the reference's logits (n x vocab float32) up to this many bytes; beyond, run the
#: reference and the modes in lockstep, chunk by chunk (no stored logits, all caches alive at once).
MAX_REFERENCE_BYTES = 1_600_000_000


def _log_softmax64(logits: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.double(), dim=-1)


def kl_from_log_probs(ref_logp: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    """KL(ref || mode) over the last axis from float64 log-probabilities (..., V) -> (...).

    ``sum_v p_ref (log p_ref - log p_mode)``: exactly 0 for identical inputs. Mathematically >= 0; the
    float64 rounding of near-identical distributions is clamped at 0.
    """
    return (ref_logp.exp() * (ref_logp - logp)).sum(-1).clamp_min(0.0)


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
            kl = kl_from_log_probs(_log_softmax64(ref), logp)
            self.kld[sl] = kl.cpu()
            self.agree[sl] = (logits.argmax(-1) == ref.argmax(-1)).cpu()


@dataclass
class PerplexityResult:
    """Per-token measurements of one mode on scored tokens ``prefill .. tokens - 1``.

    nll: (n,) float64 negative log-likelihood of each scored token.
    kld: (n,) float64 KL(reference || mode) of each next-token distribution, or None without a reference.
    agree: (n,) bool, the mode's argmax equals the reference's, or None without a reference.
    bits: the cache's bits per stored K/V element after the run (``tokens - 1`` tokens seen: the last
    token is only a target), or None when not measured.
    """

    config: str
    tokens: int
    prefill: int
    chunk: int
    nll: torch.Tensor
    kld: torch.Tensor | None = None
    agree: torch.Tensor | None = None
    bits: KVBits | None = None

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

    @property
    def bits_per_element(self) -> float:
        return float("nan") if self.bits is None else self.bits.bits_per_element

    def curve(self, bucket: int = 256) -> list[dict]:
        """Perplexity (and mean KL) per bucket of token positions ``[k*bucket, (k+1)*bucket)``.

        Positions are those of the predicted tokens in the text, so with StreamingLLM the curve shows
        where eviction starts to cost. Buckets are clipped to the scored range.
        """
        check_int("bucket", bucket, 1, "tokens per curve point")
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
        """The JSON record: config, ppl, ppl_stderr, kld_mean, kld_p99, kld_max, top1, ppl_ratio,
        scored_tokens, curve, bits_per_element and bits (:meth:`KVBits.record`, None if not measured)."""
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
            "bits_per_element": self.bits_per_element,
            "bits": None if self.bits is None else self.bits.record(),
        }


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

    Scores tokens ``prefill .. N-1`` (see :func:`kvslim.generate.teacher_forced`). With
    ``reference_logits`` ``(N - prefill, V)`` — the reference's raw next-token logits for the same
    tokens, e.g. from ``keep_logits=True`` — also KL(reference || this) per token in float64 over the
    full vocabulary and top-1 agreement. With ``keep_logits`` returns ``(result, logits)``, ``logits``
    being ``(N - prefill, V)`` float32 (``4 * n * V`` bytes). ``result.bits``: the cache's bits per
    stored K/V element at the end (``N - 1`` tokens seen).
    """
    ids = _one_row(token_ids)
    n_tokens = ids.shape[1]
    check_teacher_forcing(n_tokens, prefill, chunk)
    n = n_tokens - prefill
    if reference_logits is not None and reference_logits.shape[0] != n:
        raise ValueError(
            f"reference_logits must have one row per scored token ({n} = {n_tokens} tokens - prefill {prefill}), "
            f"got shape {tuple(reference_logits.shape)}"
        )
    scorer = _Scorer(ids[0, prefill:].cpu(), with_reference=reference_logits is not None)
    kept = None
    cache = cache_factory()
    with progress_bar(n, label or "ppl", progress) as bar:
        for first, logits in teacher_forced(model, ids, cache, prefill=prefill, chunk=chunk):
            c = logits.shape[0]
            ref = None if reference_logits is None else reference_logits[first : first + c]
            scorer.add(first, logits, ref)
            if keep_logits:
                if kept is None:
                    kept = torch.empty(n, logits.shape[1], dtype=torch.float32)
                kept[first : first + c] = logits.cpu()
            bar.update(c)
    result = PerplexityResult(
        label, n_tokens, prefill, chunk, scorer.nll, scorer.kld, scorer.agree, kv_bits(cache)
    )
    return (result, kept) if keep_logits else result


def full_forward_nll(model, token_ids: torch.Tensor, *, prefill: int) -> torch.Tensor:
    """NLL (float64) of tokens ``prefill .. N-1`` from one plain forward over the whole sequence, no cache.

    The ground truth the cached path must reproduce for the reference mode. Returns (N - prefill,).
    """
    ids = _one_row(token_ids).to(model.device)
    check_teacher_forcing(ids.shape[1], prefill, 1)
    with torch.inference_mode():
        # The one forward in kvslim outside kvslim.generate, on purpose: a reference must not share
        # the code it checks. No cache and no position ids — the model numbers the whole sequence
        # 0..N-1 itself — so a bug in generate's positions or in a cache cannot hide here.
        logits = model(ids, use_cache=False).logits[0, prefill - 1 : -1]  # (n, V)
    logp = _log_softmax64(logits.float())
    return -logp.gather(1, ids[0, prefill:, None])[:, 0].cpu()


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
    make = cache_maker(model, make_cache)
    ids = _one_row(token_ids)
    n_tokens = ids.shape[1]
    check_teacher_forcing(n_tokens, prefill, chunk)
    n = n_tokens - prefill
    vocab = model.config.vocab_size
    if 4 * n * vocab > max_reference_bytes:
        return PerplexityReport(
            _lockstep(model, ids, modes, make, prefill=prefill, chunk=chunk, progress=progress)
        )
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


def _lockstep(
    model, ids: torch.Tensor, modes: list[Mode], make: CacheMaker, *, prefill: int, chunk: int, progress: bool
) -> list[PerplexityResult]:
    """Every mode through its own cache, chunk by chunk together; ``modes[0]`` is the reference."""
    n_tokens = ids.shape[1]
    n = n_tokens - prefill
    targets = ids[0, prefill:].cpu()
    caches = [make(m.config) for m in modes]
    gens = [teacher_forced(model, ids, c, prefill=prefill, chunk=chunk) for c in caches]
    scorers = [_Scorer(targets, with_reference=True) for _ in modes]
    with progress_bar(n, f"ppl ({len(modes)} modes in lockstep)", progress) as bar:
        for outs in zip(*gens):
            first, ref_logits = outs[0]
            for scorer, (_, logits) in zip(scorers, outs):
                scorer.add(first, logits, ref_logits)
            bar.update(ref_logits.shape[0])
    return [
        PerplexityResult(m.label, n_tokens, prefill, chunk, s.nll, s.kld, s.agree, kv_bits(c))
        for m, s, c in zip(modes, scorers, caches)
    ]
