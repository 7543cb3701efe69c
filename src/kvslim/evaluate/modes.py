"""The modes of an evaluation run: labelled cache configs, the reference ``none`` first.

Also what every measurement shares: the cache maker (``make_cache(CacheConfig) -> Cache``), the
progress bar, and integer-argument validation. Knows nothing about models or metrics.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ..checks import check_int as base_check_int
from ..config import CacheConfig, parse_spec

#: The spec of the reference mode: the model's own dtype, nothing evicted.
REFERENCE = "none"

CacheMaker = Callable[[CacheConfig], object]


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
    from ..cache.adapter import SlimCache

    def make(cfg: CacheConfig):
        return SlimCache.from_config(cfg, config=model_config)

    return make


def cache_maker(model, make_cache: CacheMaker | None) -> CacheMaker:
    """``make_cache`` if given, else SlimCaches for ``model``'s config."""
    return make_cache if make_cache is not None else slim_cache_maker(model.config)


def progress_bar(total: int, desc: str, enabled: bool, unit: str = "tok"):
    """A tqdm bar on stderr (a no-op object when not ``enabled``)."""
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, disable=not enabled, leave=False, unit=unit, dynamic_ncols=True)


def check_int(name: str, value, minimum: int, meaning: str = "") -> None:
    """:func:`kvslim.checks.check_int` worded for evaluation arguments: ``meaning`` explains the value."""
    note = f" ({meaning})" if meaning else ""
    base_check_int(name, value, minimum=minimum, expected=f"an integer >= {minimum}{note}")
