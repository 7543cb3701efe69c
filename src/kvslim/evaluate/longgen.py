"""Long generation: every mode free-runs greedily for N tokens; where it leaves the reference, and how
far its own continuation drifts from what the reference would say.

Teacher-forced perplexity and KL (:mod:`.perplexity`) feed every mode the *same* text, so an error never
feeds back: a wrong prediction is scored and forgotten. In free-running generation a mode reads its own
earlier tokens, and one early slip changes everything after it; this is where 2025-26 low-bit work
measures (OSCAR, KVarN: thousands of generated tokens). Per prompt, every mode generates ``tokens``
tokens greedily through its own cache, one decode step per token (:func:`kvslim.generate.prefill` and
:func:`~kvslim.generate.decode_one_token`, which own the forwards and the positions), and is scored
three ways:

- **first divergence** ``d``: the index (0-based, in the continuation) of the first token that differs
  from the reference's own greedy continuation: tokens ``0 .. d-1`` match, and ``matched = d``. None
  (``matched = n``) when all ``n`` tokens match. ``prefix = matched / n``.
- **position-wise match**: the fraction of positions ``t`` where the mode's token ``t`` equals the
  reference's token ``t``. After a divergence the two texts seldom line up again, so this is the prefix
  plus chance re-alignments; it is the usual "agreement" number, reported beside the prefix.
- **the mode's own continuation, scored by the reference**: a reference cache is teacher-forced the
  mode's own tokens in lockstep with its generation (the same prompt forward, then the same single
  tokens), and at every position ``t`` it records KL(reference || mode) of the two next-token
  distributions (float64, full vocabulary), whether the reference's argmax is the mode's token
  ("ref top-1"), and the reference's NLL of that token ("ref ppl" = exp of its mean). The mode's
  distribution comes from its own generation, so an error that compounds (a history drifting to text
  the reference would not write) shows as KL growing with position (:meth:`LongResult.curve`), where
  teacher forcing on a fixed text cannot show it.

EOS is a token like any other by default: every run has exactly ``tokens`` tokens, so every position
compares like with like. With ``stop_at_eos`` a prompt's run ends where the *reference* emits a stop
token (that token included) and every mode runs exactly as long.

The reference ``none`` runs first; its row is matched ``n``, KL 0 and ref top-1 1 by construction
(scoring it would repeat its own forwards), its ref ppl that of its own text. A mode whose forwards equal
the reference's (a window longer than the run) gets exactly the same numbers from the measurement: the
lockstep compares the logits of identical forwards. Cost per prompt: ``n`` decode steps for the
reference, ``2n`` for every other mode (its own and the reference's scoring steps); two caches alive at a
time, no logits stored.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from ..config import CacheConfig
from ..generate import decode_one_token, prefill
from .greedy import Prompt, _stop_ids, encode_prompt
from .memory import KVBits, longest
from .modes import CacheMaker, cache_maker, check_int, progress_bar, resolve_modes
from .perplexity import _log_softmax64, kl_from_log_probs

#: The default prompts: texts that continue for thousands of tokens (a story, history, code) and two chat
#: requests for long answers.
LONG_PROMPTS: tuple[Prompt, ...] = (
    Prompt("story", "Once upon a time, in a small village at the edge of a dark forest, there lived an old"),
    Prompt("history", "The history of the printing press begins in"),
    Prompt("code", 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'),
    Prompt(
        "essay",
        "Write a long, detailed essay on how the steam engine changed the world, with an introduction, "
        "several sections and a conclusion.",
        chat=True,
    ),
    Prompt(
        "tutorial",
        "Explain step by step how to solve quadratic equations, with several worked examples.",
        chat=True,
    ),
)


@dataclass
class LongRun:
    """One prompt's free run of one mode.

    tokens: the mode's continuation (n token ids). match: (n,) bool, token t equals the reference's
    token t. kld, ref_nll: (n,) float64; ref_agree: (n,) bool — at position t, KL(reference || mode),
    the reference's NLL of the mode's token t, and whether the reference's argmax is that token, the
    reference having read the mode's own tokens 0..t-1.
    """

    name: str
    prompt_tokens: int
    tokens: list[int]
    match: torch.Tensor
    kld: torch.Tensor
    ref_agree: torch.Tensor
    ref_nll: torch.Tensor

    @property
    def n(self) -> int:
        return len(self.tokens)

    @property
    def first_divergence(self) -> int | None:
        """Index of the first token that differs from the reference's, or None."""
        differ = (~self.match).nonzero()
        return int(differ[0, 0]) if differ.numel() else None

    @property
    def position_match(self) -> float:
        return float(self.match.double().mean()) if self.n else 1.0

    @property
    def matched(self) -> int:
        """Tokens before the first divergence (``n`` when there is none)."""
        return self.n if self.first_divergence is None else self.first_divergence

    @property
    def prefix(self) -> float:
        return self.matched / self.n if self.n else 1.0

    def record(self) -> dict:
        return {
            "name": self.name,
            "prompt_tokens": self.prompt_tokens,
            "generated": self.n,
            "first_divergence": self.first_divergence,
            "matched": self.matched,
            "prefix": self.prefix,
            "position_match": self.position_match,
            "kld_mean": float(self.kld.mean()) if self.n else float("nan"),
            "ref_top1": float(self.ref_agree.double().mean()) if self.n else float("nan"),
        }


@dataclass
class LongResult:
    """Every prompt's free run of one mode; ``bits``: its cache's bits per stored K/V element after its
    longest run (``prompt + n - 1`` tokens seen: the last token is never fed back)."""

    config: str
    runs: list[LongRun] = field(default_factory=list)
    bits: KVBits | None = None

    def _cat(self, name: str) -> torch.Tensor:
        return torch.cat([getattr(r, name) for r in self.runs]) if self.runs else torch.zeros(0)

    @property
    def diverged(self) -> int:
        return sum(r.first_divergence is not None for r in self.runs)

    @property
    def divergence_min(self) -> int:
        """The smallest ``matched`` over the prompts (the run length when none diverged)."""
        return min(r.matched for r in self.runs)

    @property
    def divergence_median(self) -> int:
        """The lower median of ``matched`` over the prompts: one prompt's real value, never an average
        of two (a run that never diverged counts as its length)."""
        return statistics.median_low(r.matched for r in self.runs)

    @property
    def prefix_mean(self) -> float:
        return sum(r.prefix for r in self.runs) / len(self.runs)

    @property
    def match_mean(self) -> float:
        """Position-wise match pooled over every position of every prompt."""
        match = self._cat("match")
        return float(match.double().mean()) if match.numel() else float("nan")

    @property
    def kld_mean(self) -> float:
        kld = self._cat("kld")
        return float(kld.mean()) if kld.numel() else float("nan")

    @property
    def kld_p99(self) -> float:
        kld = self._cat("kld")
        return float(torch.quantile(kld, 0.99)) if kld.numel() else float("nan")

    @property
    def kld_max(self) -> float:
        kld = self._cat("kld")
        return float(kld.max()) if kld.numel() else float("nan")

    @property
    def ref_top1(self) -> float:
        agree = self._cat("ref_agree")
        return float(agree.double().mean()) if agree.numel() else float("nan")

    @property
    def ref_ppl(self) -> float:
        nll = self._cat("ref_nll")
        return math.exp(float(nll.mean())) if nll.numel() else float("nan")

    @property
    def bits_per_element(self) -> float:
        return float("nan") if self.bits is None else self.bits.bits_per_element

    def curve(self, bucket: int = 256) -> list[dict]:
        """Per bucket of generated positions ``[k*bucket, (k+1)*bucket)``, pooled over prompts: mean KL,
        ref top-1, position-wise match, and ``alive`` (the fraction of runs that had not diverged before
        the bucket's start). KL rising with position is error that compounds."""
        check_int("bucket", bucket, 1, "generated positions per curve point")
        n = max((r.n for r in self.runs), default=0)
        out = []
        for start in range(0, n, bucket):
            end = min(start + bucket, n)
            runs = [r for r in self.runs if r.n > start]
            kld = torch.cat([r.kld[start:end] for r in runs])
            agree = torch.cat([r.ref_agree[start:end] for r in runs])
            match = torch.cat([r.match[start:end] for r in runs])
            out.append(
                {
                    "start": start,
                    "end": end,
                    "kld_mean": float(kld.mean()),
                    "ref_top1": float(agree.double().mean()),
                    "match": float(match.double().mean()),
                    "alive": sum(r.matched >= start for r in runs) / len(runs),
                }
            )
        return out

    def summary(self, bucket: int = 256) -> dict:
        """The JSON record (see the module docstring for each number's definition)."""
        return {
            "config": self.config,
            "bits_per_element": self.bits_per_element,
            "bits": None if self.bits is None else self.bits.record(),
            "diverged": self.diverged,
            "prompts_run": len(self.runs),
            "divergence_min": self.divergence_min,
            "divergence_median": self.divergence_median,
            "prefix_mean": self.prefix_mean,
            "match": self.match_mean,
            "kld_mean": self.kld_mean,
            "kld_p99": self.kld_p99,
            "kld_max": self.kld_max,
            "ref_top1": self.ref_top1,
            "ref_ppl": self.ref_ppl,
            "generated_tokens": sum(r.n for r in self.runs),
            "curve": self.curve(bucket),
            "prompts": [r.record() for r in self.runs],
        }


@dataclass
class LongReport:
    """The results of :func:`long_generation`, the reference first."""

    results: list[LongResult]
    #: The reference's continuation of each prompt (token ids).
    reference_tokens: list[list[int]]

    def records(self, bucket: int = 256) -> list[dict]:
        return [r.summary(bucket) for r in self.results]


def long_generation(
    model,
    tokenizer,
    prompts: Sequence[Prompt | str | Sequence[int]] | None = None,
    configs: Iterable[str | CacheConfig] = (),
    *,
    tokens: int = 2048,
    stop_at_eos: bool = False,
    progress: bool = True,
    make_cache: CacheMaker | None = None,
) -> LongReport:
    """Free-running greedy generation of ``tokens`` tokens per prompt, every mode against the reference.

    See the module docstring for what is measured. ``prompts`` defaults to :data:`LONG_PROMPTS` (text,
    :class:`Prompt` or token ids); ``stop_at_eos``: end each prompt's runs where the reference emits the
    tokenizer's EOS (else every run is exactly ``tokens`` long).
    """
    check_int("tokens", tokens, 1, "tokens generated per prompt")
    if not isinstance(stop_at_eos, bool):
        raise ValueError(f"stop_at_eos must be True or False, got {stop_at_eos!r}")
    prompts = list(LONG_PROMPTS if prompts is None else prompts)
    if not prompts:
        raise ValueError("no prompts given")
    modes = resolve_modes(configs)
    make = cache_maker(model, make_cache)
    stops = set(_stop_ids(tokenizer)) if stop_at_eos else set()
    encoded = [encode_prompt(tokenizer, p) for p in prompts]
    names = [p.name if isinstance(p, Prompt) else f"prompt{i}" for i, p in enumerate(prompts)]
    results = [LongResult(m.label) for m in modes]
    refs: list[list[int]] = []
    per_token = 2 * len(modes) - 1  # forwards per generated position: the reference's, two per other mode
    with progress_bar(len(prompts) * tokens * per_token, "long", progress, unit="step") as bar:
        for name, ids in zip(names, encoded):
            cache = make(modes[0].config)
            ref = _free_run(model, ids, cache, None, tokens, stops, bar)
            results[0].bits = longest(results[0].bits, cache)
            if len(ref.tokens) < tokens:  # stopped at EOS: every mode runs as long as the reference
                bar.total -= (tokens - len(ref.tokens)) * per_token
                bar.refresh()
            refs.append(ref.tokens)
            results[0].runs.append(_score(name, ids.shape[1], ref, ref.tokens))
            for m, res in zip(modes[1:], results[1:]):
                cache = make(m.config)
                run = _free_run(model, ids, cache, make(modes[0].config), len(ref.tokens), set(), bar)
                res.bits = longest(res.bits, cache)
                res.runs.append(_score(name, ids.shape[1], run, ref.tokens))
    return LongReport(results, refs)


@dataclass
class _Run:
    tokens: list[int]
    kld: torch.Tensor
    ref_agree: torch.Tensor
    ref_nll: torch.Tensor


@torch.inference_mode()
def _free_run(model, ids: torch.Tensor, cache, reference, n: int, stops: set[int], bar) -> _Run:
    """Greedy-decode ``n`` tokens after ``ids`` (1, T) through ``cache`` (stopping after a token in
    ``stops``); with a ``reference`` cache, teacher-force the same tokens through it in lockstep and
    score every position against it (else the run is its own reference: KL 0, top-1 1)."""
    ids = ids.to(model.device)
    logits = prefill(model, ids, cache)[0]  # (V,) predicts token 0
    ref_logits = logits if reference is None else prefill(model, ids, reference)[0]
    out: list[int] = []
    kld = torch.zeros(n, dtype=torch.float64)
    agree = torch.ones(n, dtype=torch.bool)
    nll = torch.empty(n, dtype=torch.float64)
    for t in range(n):
        tok = int(logits.argmax())
        out.append(tok)
        ref_logp = _log_softmax64(ref_logits)  # (V,)
        nll[t] = -ref_logp[tok].cpu()
        if reference is not None:
            kld[t] = kl_from_log_probs(ref_logp, _log_softmax64(logits)).cpu()
            agree[t] = int(ref_logits.argmax()) == tok
        bar.update(1 if reference is None else 2)
        if t + 1 == n or tok in stops:
            break
        step = torch.tensor([[tok]], device=ids.device)
        logits = decode_one_token(model, step, cache)[0]
        ref_logits = logits if reference is None else decode_one_token(model, step, reference)[0]
    k = len(out)
    return _Run(out, kld[:k], agree[:k], nll[:k])


def _score(name: str, prompt_tokens: int, run: _Run, ref: Sequence[int]) -> LongRun:
    """A run's divergence from the reference's continuation ``ref`` (as long as the run)."""
    if len(ref) != len(run.tokens):
        raise ValueError(f"a run of {len(run.tokens)} tokens is compared with a reference of {len(ref)}")
    match = torch.tensor([a == b for a, b in zip(run.tokens, ref)], dtype=torch.bool)  # (n,)
    return LongRun(name, prompt_tokens, run.tokens, match, run.kld, run.ref_agree, run.ref_nll)
