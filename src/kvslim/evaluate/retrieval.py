"""Passkey retrieval: a 5-digit key hidden in filler text, the model asked to repeat it.

Each prompt is read and answered by :func:`kvslim.generate.greedy` through a fresh cache, the prompt
fed in chunks so a StreamingLLM cache evicts while reading. This module builds the haystacks and
grades the answers; it knows nothing about positions or how a cache stores tokens.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from ..config import CacheConfig
from ..generate import greedy
from .memory import KVBits, longest
from .modes import CacheMaker, cache_maker, check_int, progress_bar, resolve_modes

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
    """One mode's accuracy per cell; ``bits``: its cache's bits per stored K/V element after its longest
    prompt and answer."""

    config: str
    cells: list[PasskeyCell] = field(default_factory=list)
    bits: KVBits | None = None

    @property
    def bits_per_element(self) -> float:
        return float("nan") if self.bits is None else self.bits.bits_per_element

    @property
    def accuracy(self) -> float:
        total = sum(c.trials for c in self.cells)
        return sum(c.correct for c in self.cells) / total if total else float("nan")

    def summary(self) -> dict:
        return {
            "config": self.config,
            "accuracy": self.accuracy,
            "bits_per_element": self.bits_per_element,
            "bits": None if self.bits is None else self.bits.record(),
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
    check_int("trials", trials, 1)
    check_int("chunk", chunk, 1, "prompt tokens per forward")
    modes = resolve_modes(configs)
    make = cache_maker(model, make_cache)
    rng = random.Random(seed)
    grid = [
        (length, depth, build_passkey_prompt(tokenizer, length, depth, str(rng.randint(10000, 99999))))
        for length in lengths
        for depth in depths
        for _ in range(trials)
    ]
    results = [PasskeyResult(m.label) for m in modes]
    with progress_bar(len(grid) * len(modes), "passkey", progress, unit="run") as bar:
        for res, m in zip(results, modes):
            cells: dict[tuple[int, float], PasskeyCell] = {}
            for length, depth, p in grid:
                cache = make(m.config)
                out = greedy(model, p.ids, cache, answer_tokens, prefill_chunk=chunk)
                res.bits = longest(res.bits, cache)
                answer = tokenizer.decode(out, skip_special_tokens=True)
                cell = cells.setdefault((length, depth), PasskeyCell(length, depth, p.ids.shape[1], 0, 0))
                cell.trials += 1
                cell.correct += passkey_answer_correct(answer, p.key)
                cell.answers.append(answer)
                bar.update(1)
            res.cells = list(cells.values())
    return PasskeyReport(results)
