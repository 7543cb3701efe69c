"""The one continuation rule: can this saved cache continue this prompt?

:func:`check_continuation` is the rule — the model (its fingerprint), its dtype, the cache settings, and
the token prefix, in that order — and every caller asks it: ``kvslim sample --prompt-cache``
(:mod:`kvslim.cli.prompt_cache`) and the server's sessions (:mod:`kvslim.engine.sessions`, which the batch
engine goes through; it checks nothing itself). It reads a :class:`SavedCache`: what the rule needs of a
saved cache, taken from a file's header and token ids (:meth:`SavedCache.read`) or from a cache held in
memory (:meth:`SavedCache.of`), without its stored tensors. :func:`can_continue` is the same rule for a
caller that must not raise. Loading (:func:`kvslim.promptcache.load`) reuses the model and settings checks
(:func:`other_model`, :func:`check_cache_config`) and adds what needs the tensors: the checksum, shapes,
resolved levers and the bias's identity.

A compressed cache is continued as it is or not at all (never cropped or re-quantized): the prompt must
start with every token the cache holds and go on past them — the rule llama.cpp's ``--prompt-cache`` and
server slots follow. This module knows nothing about how a cache stores its tensors or how one is rebuilt
(:mod:`.state`), and nothing about tokenizers or generation.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from .files import open_file, read_tensor, where_of
from .header import check_header, dtype_name, first_line


class CannotContinue(ValueError):
    """A saved cache cannot continue a prompt. ``str()`` is one line starting with ``where``; ``kind`` says
    which part of :func:`check_continuation` refused it: ``"damaged"`` (not a file this kvslim reads),
    ``"model"``, ``"dtype"``, ``"settings"`` or ``"tokens"`` (the prompt does not go on from its tokens)."""

    def __init__(self, message: str, kind: str):
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class SavedCache:
    """What the continuation rule reads of a saved cache — a file's header and token ids, or a cache a
    server keeps in memory — without its stored tensors.

    cache_config: the settings it was saved with (its K bias path as recorded, or None); centered: it holds
    mean-centered keys (a bias is compared by identity when the file is loaded, not here); model_fingerprint:
    the model's, as recorded (None: not recorded); dtypes: the dtypes of its K/V layers that hold tokens
    (sorted names, e.g. ``("float32",)``); token_ids: (B, n) int64 the ids it was filled with, or None."""

    cache_config: object  # CacheConfig (kvslim.config is not imported at module level)
    centered: bool
    model_fingerprint: str | None
    dtypes: tuple[str, ...]
    token_ids: torch.Tensor | None = None

    @classmethod
    def from_header(
        cls, header: dict, token_ids: torch.Tensor | None = None, *, where: str = "prompt cache"
    ) -> SavedCache:
        """From a prompt cache header (:func:`~kvslim.promptcache.to_state`, :func:`~.files.read_header`).
        CannotContinue (kind ``damaged``, or ``settings`` for settings this kvslim does not know) for a header
        it does not read."""

        try:
            check_header(header, where=where)
        except ValueError as e:
            raise CannotContinue(str(e), "damaged") from None
        try:
            cfg = saved_config(header)
        except ValueError as e:
            raise CannotContinue(
                f"{where}: its cache_config {header['cache_config']!r} is not valid here ({e})", "settings"
            ) from None
        dtypes = {e["dtype"] for e in header["layers"] if e["kind"] == "kv" and e["seen"] and e["dtype"]}
        return cls(
            cache_config=cfg,
            centered=header["mean_center"] is not None,
            model_fingerprint=header["model"].get("fingerprint"),
            dtypes=tuple(sorted(dtypes)),
            token_ids=token_ids,
        )

    @classmethod
    def read(cls, path: str | os.PathLike) -> SavedCache:
        """A file's header and token ids, without reading its other tensors (the rule runs before the load).
        CannotContinue (kind ``damaged``, one line naming the file) for a file this kvslim does not read.
        The checksum is verified by :func:`~kvslim.promptcache.load`, not here."""
        from safetensors import SafetensorError

        where = where_of(path)
        try:
            names, header = open_file(path, where=where)
        except ValueError as e:
            raise CannotContinue(str(e), "damaged") from None
        token_ids = None
        if "token_ids" in names:
            try:
                token_ids = read_tensor(path, "token_ids")
            except (SafetensorError, OSError, RuntimeError, ValueError) as e:
                raise CannotContinue(
                    f"{where}: cannot read its token ids ({first_line(e)}): a damaged or truncated file", "damaged"
                ) from None
        if (None if token_ids is None else list(token_ids.shape)) != header.get("tokens") or (
            token_ids is not None and token_ids.dtype != torch.long
        ):
            raise CannotContinue(
                f"{where}: its token ids do not match its header (a damaged or edited file)", "damaged"
            )
        return cls.from_header(header, token_ids, where=where)

    @classmethod
    def of(cls, cache, tokens, *, cache_config, model_fingerprint: str | None = None) -> SavedCache:
        """A cache held in memory (a session this process kept): ``tokens`` the ids it holds (one row),
        ``cache_config`` the settings it was made with. ``cache`` is read through ``cache.stores()`` (each
        store's ``dtype``, None before its first tokens)."""
        dtypes = {dtype_name(s.dtype) for s in cache.stores() if s.dtype is not None}
        return cls(
            cache_config=cache_config,
            centered=cache_config.mean_center is not None,
            model_fingerprint=model_fingerprint,
            dtypes=tuple(sorted(dtypes)),
            token_ids=torch.tensor([list(tokens)], dtype=torch.long),
        )


def check_continuation(
    saved: SavedCache,
    prompt=None,
    *,
    cache_config=None,
    model_fingerprint: str | None = None,
    dtype: torch.dtype | str | None = None,
    where: str = "prompt cache",
) -> int | None:
    """The one continuation rule (``kvslim sample --prompt-cache``, the server's sessions): can the saved
    cache ``saved`` continue ``prompt``? Checked in this order, each only when its argument is given (a
    caller may check the settings before the model is loaded, and the rest after):

    1. model: the fingerprint it records is ``model_fingerprint`` (a cache without one is checked by shapes
       when it is loaded);
    2. dtype: its layers hold ``dtype`` K/V (the model's dtype: a cache saved from a float32 model is not
       continued by a bfloat16 one — the fingerprint is the same for both, see
       :mod:`kvslim.calibration.fingerprint`);
    3. settings: it was saved with ``cache_config`` (a CacheConfig or spec: the same format, policy and
       levers; a K bias if and only if one is asked for — :func:`check_cache_config`);
    4. tokens: ``prompt`` ((B, T) tensor, or one row of ints) starts with its token ids and goes on past them
       (:func:`continued_prefix`: a saved cache is continued as it is, never cropped).

    Returns how many leading prompt tokens it holds (with ``prompt``; None without). Raises
    :class:`CannotContinue` (one line starting with ``where``; ``kind`` names the check) otherwise.
    Loading the file (:func:`~kvslim.promptcache.load`) still checks what needs the tensors and the model's
    config: the checksum, shapes, resolved levers and the bias's identity."""
    why = other_model(saved.model_fingerprint, model_fingerprint)
    if why:
        raise CannotContinue(f"{where}: {why}", "model")
    if dtype is not None:
        name = dtype if isinstance(dtype, str) else dtype_name(dtype)
        if saved.dtypes and saved.dtypes != (name,):
            raise CannotContinue(
                f"{where}: saved from a {', '.join(saved.dtypes)} model, this one runs in {name}", "dtype"
            )
    if cache_config is not None:
        try:
            check_settings(saved.cache_config, saved.centered, cache_config, where=where)
        except ValueError as e:
            raise CannotContinue(str(e), "settings") from None
    if prompt is None:
        return None
    ids = prompt if isinstance(prompt, torch.Tensor) else torch.tensor([list(prompt)], dtype=torch.long)
    if ids.ndim != 2 or ids.shape[1] == 0:
        raise CannotContinue(f"{where}: the prompt must be a non-empty (batch, tokens) tensor of ids", "tokens")
    try:
        return continued_prefix(saved.token_ids, ids, where=where)
    except ValueError as e:
        raise CannotContinue(str(e), "tokens") from None


def can_continue(
    saved: SavedCache,
    prompt,
    *,
    cache_config,
    model_fingerprint: str | None = None,
    dtype: torch.dtype | str | None = None,
    where: str = "prompt cache",
) -> tuple[int | None, CannotContinue | None]:
    """:func:`check_continuation` for a caller that must not raise: ``(n, None)`` when ``saved`` continues
    ``prompt`` holding its first ``n`` tokens, else ``(None, why)`` (``str(why)`` the one-line reason,
    ``why.kind`` which check)."""
    try:
        return check_continuation(
            saved,
            prompt,
            cache_config=cache_config,
            model_fingerprint=model_fingerprint,
            dtype=dtype,
            where=where,
        ), None
    except CannotContinue as e:
        return None, e


def continued_prefix(
    cached: torch.Tensor | None, token_ids: torch.Tensor, *, where: str = "prompt cache"
) -> int:
    """How many leading tokens of ``token_ids`` (B, T) a cache filled with ``cached`` (B, n) holds: ``n``, when
    every row starts with its cached tokens and goes on past them (a prompt cache continues, it is never
    cropped). ValueError naming the first token that differs, or saying that nothing is left to feed."""
    n = 0 if cached is None else cached.shape[1]
    if cached is not None and cached.shape[0] != token_ids.shape[0]:
        raise ValueError(
            f"{where}: holds a batch of {cached.shape[0]} prompts, this one has {token_ids.shape[0]}"
        )
    if n == 0:
        return 0
    head = token_ids[:, :n].cpu()
    held = cached.cpu()
    if not torch.equal(head, held[:, : head.shape[1]]) or head.shape[1] < n:
        differ = (head != held[:, : head.shape[1]]).any(dim=0).nonzero()
        first = int(differ[0, 0]) if differ.numel() else head.shape[1]
        raise ValueError(
            f"{where}: the prompt does not start with the {n} tokens the file holds (they differ from token {first} "
            f"on): use the prompt it was made with, or another file"
        )
    if token_ids.shape[1] == n:
        raise ValueError(
            f"{where}: the prompt is exactly the {n} tokens the file holds, with nothing left to feed (a file holds "
            f"a prompt but its last token): extend the prompt, or use another file"
        )
    return n


def check_cache_config(header: dict, cache_config, *, where: str = "prompt cache") -> None:
    """ValueError unless the header's cache settings are ``cache_config`` (a CacheConfig or spec): the same
    format, policy and levers as asked, and a K bias if and only if one is asked for (a bias is compared
    by identity when the cache is loaded, not by its path)."""

    check_settings(saved_config(header), header.get("mean_center") is not None, cache_config, where=where)


def saved_config(header: dict):
    """The CacheConfig a header's ``cache_config`` spec was saved with. Its ``sink=auto`` stays auto where that
    resolves to the sinks the file holds, else it is pinned to them: ``levers.sink`` as recorded (should a later
    kvslim's auto resolve otherwise), or, in a file from before ``sink=auto`` (no ``levers.sink``), the 0 it
    meant then."""
    from ..config import parse_spec

    cfg = parse_spec(header["cache_config"])
    if cfg.sink == "auto":
        held = header.get("levers", {}).get("sink", 0)
        held = held if isinstance(held, int) and not isinstance(held, bool) and held >= 0 else 0
        if cfg.sink_tokens != held:
            cfg = cfg.replace(sink=held)
    return cfg


def check_settings(saved, centered: bool, cache_config, *, where: str) -> None:
    """ValueError unless ``saved`` (a CacheConfig; ``centered``: it holds mean-centered keys) are the
    settings ``cache_config`` (a CacheConfig or spec) asks for, the K bias path aside (sinks compared as
    resolved: ``auto`` is the number it stands for)."""
    from ..config import parse_spec

    saved = saved.replace(mean_center=None)
    want = parse_spec(cache_config) if isinstance(cache_config, str) else cache_config
    want_n, saved_n = want.replace(mean_center=None, sink=want.sink_tokens), saved.replace(sink=saved.sink_tokens)
    if want_n != saved_n:
        hint = ""
        if want_n.replace(sink=0) == saved_n.replace(sink=0):  # the sinks alone differ
            hint = (
                f" (it holds {saved_n.sink} sinks, the settings ask {want_n.sink}; sink=auto keeps 16 where a cache "
                "quantizes without a window, and a file from before sink=auto has none: ask sink="
                f"{saved_n.sink})"
            )
        raise ValueError(
            f"{where}: saved with cache {saved.to_spec()!r}, expected {want.replace(mean_center=None).to_spec()!r}"
            + hint
        )
    if (want.mean_center is not None) != centered:
        raise ValueError(
            f"{where}: saved {'with' if centered else 'without'} K mean-centering, expected "
            f"{'with' if want.mean_center else 'without'}"
        )


def other_model(recorded: str | None, mine: str | None) -> str | None:
    """Why a cache recording model fingerprint ``recorded`` is not this model's (``mine``), or None."""
    if recorded and mine and recorded != mine:
        return (
            f"saved for another model: the file records model fingerprint {recorded[:23]}..., this model's is "
            f"{mine[:23]}..."
        )
    return None
