"""Greedy prefix match: the fraction of the reference's greedy continuation a mode reproduces.

The seed's metric. Every continuation is decoded by :func:`kvslim.generate.greedy` (one decode step
per token, through a fresh cache per prompt and mode); this module holds the prompts and the scoring.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from ..config import CacheConfig
from ..generate import greedy
from .memory import KVBits, longest
from .modes import CacheMaker, cache_maker, check_int, progress_bar, resolve_modes


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
    """One mode's prefix matches; ``bits``: its cache's bits per stored K/V element after its longest run
    (a mode that diverges stops early, so its runs can be shorter than the reference's)."""

    config: str
    prompts: list[PromptMatch] = field(default_factory=list)
    bits: KVBits | None = None

    @property
    def bits_per_element(self) -> float:
        return float("nan") if self.bits is None else self.bits.bits_per_element

    @property
    def prefix_match_mean(self) -> float:
        return sum(p.prefix_match for p in self.prompts) / len(self.prompts) if self.prompts else float("nan")

    def summary(self) -> dict:
        return {
            "config": self.config,
            "prefix_match_mean": self.prefix_match_mean,
            "bits_per_element": self.bits_per_element,
            "bits": None if self.bits is None else self.bits.record(),
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
    check_int("tokens", tokens, 1, "tokens generated per prompt")
    prompts = list(BUILTIN_PROMPTS if prompts is None else prompts)
    if not prompts:
        raise ValueError("no prompts given")
    modes = resolve_modes(configs)
    make = cache_maker(model, make_cache)
    stops = _stop_ids(tokenizer)
    encoded = [encode_prompt(tokenizer, p) for p in prompts]
    names = [p.name if isinstance(p, Prompt) else f"prompt{i}" for i, p in enumerate(prompts)]
    results = [GreedyResult(m.label) for m in modes]
    refs: list[list[int]] = []
    with progress_bar(len(prompts) * len(modes), "greedy", progress, unit="run") as bar:
        for name, ids in zip(names, encoded):
            cache = make(modes[0].config)
            ref = greedy(model, ids, cache, tokens, stop_ids=stops)
            results[0].bits = longest(results[0].bits, cache)
            refs.append(ref)
            results[0].prompts.append(PromptMatch(name, len(ref), len(ref), ids.shape[1]))
            bar.update(1)
            for m, res in zip(modes[1:], results[1:]):
                cache = make(m.config)
                out = greedy(model, ids, cache, len(ref), stop_ids=stops, follow=ref)
                res.bits = longest(res.bits, cache)
                matched = next(
                    (i for i, (a, b) in enumerate(zip(out, ref)) if a != b), min(len(out), len(ref))
                )
                res.prompts.append(PromptMatch(name, matched, len(ref), ids.shape[1]))
                bar.update(1)
    return GreedyReport(results, refs)
