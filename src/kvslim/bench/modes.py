"""The cache modes under test and the attention implementation they run with.

A :class:`Mode` builds a fresh, empty cache: transformers' plain ``DynamicCache`` (always present, as
``dynamic``, the baseline), a kvslim spec, or a peer (transformers' ``QuantizedCache`` with an
optional backend package, whose absence is a note, not an error). This module builds and validates
modes; it never runs the model.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

DYNAMIC = "dynamic"
ATTN_CHOICES = ("sdpa", "kvslim", "auto")
#: transformers' QuantizedCache backends that need an optional package: backend -> (module, pip name).
PEER_PACKAGES = {"quanto": ("optimum.quanto", "optimum-quanto"), "hqq": ("hqq", "hqq")}
PEER_NBITS = (4, 2)
#: transformers' QuantizedCache backends benched by ``peers=True`` (``fp8`` needs no extra package).
PEER_BACKENDS = ("quanto", "hqq", "fp8")


@dataclass(frozen=True)
class Mode:
    """One cache mode under test.

    name: the table label (``dynamic``, a canonical kvslim spec, or a peer such as ``quanto-int4``).
    kind: ``dynamic`` | ``kvslim`` | ``peer``.
    make: builds a fresh, empty cache.
    bits: nominal bits of one K and V code (the format registry's ``bits``: 4 for int4/q4_0, 16 for
        fp16; a peer's ``nbits``), None for ``dynamic``, ``none`` and kvslim modes whose K and V
        formats differ; used only to pair kvslim modes with peers of the same width.
    window: the StreamingLLM window (None: unbounded).
    compiled: the mode's cache has a fixed shape and its decode steps run compiled (``bench --compile``); a
        ``pages`` mode's, the compiled paged step's wrapper (``"python"`` or ``"cpp"``) where it runs through it.
    """

    name: str
    kind: str
    make: Callable[[], object] = field(repr=False, compare=False)
    bits: int | None = None
    window: int | None = None
    compiled: bool | str = False  # run through a compiled decode step (kvslim.compiled; pages: its wrapper)


def peer_availability() -> dict[str, str | None]:
    """For each optional peer backend: None when importable, else why not (one line)."""
    out: dict[str, str | None] = {}
    for backend, (module, pip_name) in PEER_PACKAGES.items():
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        out[backend] = None if found else f"{pip_name} is not installed (pip install {pip_name})"
    return out


def build_modes(
    model, configs: Sequence[str], *, peers: bool | Sequence[str] = False, compile_capacity: int | None = None
) -> tuple[list[Mode], dict[str, str]]:
    """The modes for ``configs`` (kvslim spec strings), ``dynamic`` first, then the peers if asked.

    peers: False, True (every backend of :data:`PEER_BACKENDS`), or a list of backend names.
    compile_capacity: also bench compiled modes (``bench --compile``), their caches holding at most this many
    tokens: transformers' ``StaticCache`` (``tf-static``, the peer a speed-minded user compiles) and each spec
    as a :class:`~kvslim.StaticSlimCache` (``SPEC+compiled``). None: no compiled modes.
    Returns ``(modes, peer_notes)``: ``peer_notes`` maps each requested peer backend to
    ``"available"`` or the reason it was skipped (a missing package is a note, not an error).
    """
    from transformers import DynamicCache

    from ..cache.adapter import SlimCache
    from ..config import parse_spec
    from ..formats import get_format

    backends = _peer_backends(peers)
    config = model.config
    modes = [Mode(DYNAMIC, "dynamic", lambda: DynamicCache(config=config))]
    seen_names = {DYNAMIC}
    specs = [configs] if isinstance(configs, str) else list(configs)
    for spec in specs:
        cfg = parse_spec(spec)
        name = cfg.to_spec()
        if name in seen_names:
            raise ValueError(f"cache config {spec!r} is given twice (as {name!r}); each mode is benched once")
        seen_names.add(name)
        SlimCache.from_config(cfg, config=config)  # validate against the model now, not mid-run
        bits = get_format(cfg.k_format).bits if cfg.k_format == cfg.v_format else None
        modes.append(
            Mode(name, "kvslim", lambda cfg=cfg: SlimCache.from_config(cfg, config=config), bits, cfg.window)
        )
    if compile_capacity is not None:
        modes += _compiled_modes(config, [m for m in modes if m.kind == "kvslim"], compile_capacity)
    notes: dict[str, str] = {}
    if backends:
        from transformers import QuantizedCache

        availability = peer_availability()
        for backend in backends:
            missing = availability.get(backend)  # fp8 needs no package: per-tensor scale, appended as-is
            notes[backend] = missing or "available"
            if missing:
                continue
            if backend == "fp8":
                modes.append(Mode("tf-fp8", "peer", lambda: QuantizedCache("fp8", config=config), 8))
                continue
            for nbits in PEER_NBITS:
                make = lambda b=backend, n=nbits: QuantizedCache(b, config=config, nbits=n)  # noqa: E731
                modes.append(Mode(f"{backend}-int{nbits}", "peer", make, nbits))
    return modes, notes


def _compiled_modes(config, kvslim_modes: Sequence[Mode], capacity: int) -> list[Mode]:
    """transformers' StaticCache and a StaticSlimCache per kvslim mode, each of ``capacity`` tokens."""
    from transformers import StaticCache

    from ..cache.static_adapter import StaticSlimCache
    from ..config import parse_spec

    modes = [Mode("tf-static", "peer", lambda: StaticCache(config=config, max_cache_len=capacity), compiled=True)]
    for mode in kvslim_modes:
        cfg = parse_spec(mode.name)
        make = lambda cfg=cfg: StaticSlimCache.from_config(cfg, config=config, max_cache_len=capacity)  # noqa: E731
        try:
            make()  # validated now, not mid-run
        except ValueError as e:
            raise ValueError(f"--compile cannot bench {mode.name!r}: {e}") from None
        modes.append(Mode(f"{mode.name}+compiled", "kvslim", make, mode.bits, mode.window, compiled=True))
    return modes


def _peer_backends(peers) -> list[str]:
    if isinstance(peers, bool):
        return list(PEER_BACKENDS) if peers else []
    names = [peers] if isinstance(peers, str) else list(peers)
    bad = [n for n in names if n not in PEER_BACKENDS]
    if bad:
        raise ValueError(f"unknown peer backend(s) {bad}; expected some of: {', '.join(PEER_BACKENDS)}")
    return list(dict.fromkeys(names))


def windowed_modes(model, specs: Sequence[str], *, strict: bool = False) -> list[Mode]:
    """Modes of the windowed specs among ``specs``; ``strict``: every spec must have a window."""
    from ..config import parse_spec

    specs = [specs] if isinstance(specs, str) else list(specs)
    windowed = [s for s in specs if parse_spec(s).window is not None]
    if strict and len(windowed) != len(specs):
        bad = [s for s in specs if s not in windowed]
        raise ValueError(
            f"seen_configs {bad} have no window: the tokens-seen measurement is for StreamingLLM specs "
            f"such as 'int4,sink=4,window=1020'"
        )
    modes, _ = build_modes(model, windowed)
    return [m for m in modes if m.kind == "kvslim"]


# ---------------------------------------------------------------------------------------------
# attention implementation


def kvslim_attention_available() -> bool:
    """Whether the ``kvslim`` attention function is registered with transformers (registering it:
    importing kvslim does not)."""
    from transformers import AttentionInterface

    from ..attention import register

    register()
    return "kvslim" in AttentionInterface()


def resolve_attn(choice: str) -> str:
    """``sdpa`` | ``kvslim`` | ``auto`` (kvslim when available, else sdpa) -> the implementation name."""
    if choice not in ATTN_CHOICES:
        raise ValueError(f"attn must be one of {', '.join(ATTN_CHOICES)}, got {choice!r}")
    if choice == "sdpa":
        return "sdpa"
    available = kvslim_attention_available()
    if choice == "kvslim" and not available:
        raise ValueError("attn='kvslim' but no 'kvslim' attention function is registered (kvslim.attention)")
    return "kvslim" if available else "sdpa"


@contextlib.contextmanager
def attn_implementation(model, name: str | None):
    """Switch the model's attention implementation for the block, then switch it back."""
    before = getattr(model.config, "_attn_implementation", None)
    if name is None or name == before:
        yield before
        return
    model.set_attn_implementation(name)
    try:
        yield name
    finally:
        model.set_attn_implementation(before)
