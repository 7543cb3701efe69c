"""Prompt cache files: a :class:`~kvslim.SlimCache` saved as it is and loaded back, bit for bit.

A file holds every layer's compressed state exactly as stored — sinks, each stream's encoded token and
group parts (codes, scales, zeros, the per-token ``centered`` flags), the full-precision residual, the
positions bookkeeping (``seen``, ``runs``, ``sink_rot``, ``pads``, ``sink_start``, the base) — so nothing
is decoded or re-quantized, and a restored cache continues with exactly the logits of the saved one.
As llama.cpp's ``--prompt-cache`` and ``mlx_lm.cache_prompt`` do, the file may carry the token ids the
cache was filled with, so a caller can check that a new prompt starts with them.

Layout: a safetensors file (sorted tensor names, no timestamps: the same cache gives the same bytes)
whose metadata key ``kvslim`` holds a JSON header::

    format, version          "kvslim-prompt-cache", FORMAT_VERSION (a newer file is refused)
    cache_config             CacheConfig.to_spec(): format, sink/window, group, residual, levers as asked
    levers                   what the cache resolved: rotate, pre_rope, positions, residual (tokens),
                             residual_dtype
    mean_center              None, or {path, file_sha256, bias_sha256} (bias_sha256: of the per-layer tensors)
    model                    {fingerprint (kvslim.calibration.fingerprint.model_fingerprint, or None), model_type, n_layers,
                              n_kv_heads, k_head_dim, v_head_dim}
    padding                  {explicit}: the cache's left padding was handed over (tensor ``padding.pads``)
    layers                   per model layer: {kind: "kv" | "dummy", seen, base, runs, dtype, kv_shape, v_dim,
                              k_offset, v_offset}
    tokens                   (B, T) of tensor ``token_ids``, or None
    sha256                   over the rest of the header and every tensor's name, dtype, shape and bytes
                             (a damaged file is refused)

Tensors: ``layers.{i}.{sink_k,sink_v,sink_rot,pads,sink_start}``, ``layers.{i}.{k,v}.token.{part}``,
``layers.{i}.{k,v}.group.{part}``, ``layers.{i}.{k,v}.residual``.

In memory (a server parking idle sessions): :func:`to_state` gives ``(tensors, header)`` — CPU copies and
a JSON-able dict — and :func:`from_state` builds the cache back; :func:`save` / :func:`load` add the file.

Loading rebuilds a fresh cache from the header's settings for the caller's model (``config``), checks
that it resolves the same levers and that the model and bias are the ones recorded, and fills its layers
through their own appends (:meth:`~kvslim.cache.layer.SlimLayer.restore`): a failed load builds nothing the
caller sees. Layers with a recurrent state (linear attention, SSM hybrids) are refused: their state is
not stored in these files (yet).

Continuing: whether a saved cache can continue a prompt is one rule, :func:`check_continuation` (the model,
its dtype, the cache settings, the token prefix), used by ``kvslim sample --prompt-cache`` and by the
server's sessions (:mod:`kvslim.engine.sessions`, through the non-raising :func:`can_continue`), on a
:class:`SavedCache` read from a file's header and token ids (:meth:`SavedCache.read`) or from a cache in
memory (:meth:`SavedCache.of`).

This module knows nothing about tokenizers or generation (see :mod:`kvslim.cli.sample`).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass

import torch

from ..formats import Encoded

#: What the ``format`` field of the header says.
FORMAT = "kvslim-prompt-cache"
#: The layout version this kvslim writes and reads; a file of a newer version is refused.
FORMAT_VERSION = 1
#: The safetensors metadata key holding the JSON header.
META_KEY = "kvslim"


@dataclass
class Restored:
    """A loaded prompt cache: the ``cache``, the ``token_ids`` (B, T) int64 it was filled with (None when
    the file has none) and the file's ``header``."""

    cache: object  # SlimCache (not imported here at module level: importing kvslim stays light)
    token_ids: torch.Tensor | None
    header: dict


# ---------------------------------------------------------------------------------------------
# in memory


def to_state(
    cache, *, token_ids: torch.Tensor | None = None, model_fingerprint: str | None = None
) -> tuple[dict[str, torch.Tensor], dict]:
    """A SlimCache as ``(tensors, header)``: contiguous CPU copies of every stored tensor, and the JSON-able
    header of the module docstring. token_ids: (B, T) the ids the cache was filled with (stored as given);
    model_fingerprint: :func:`kvslim.calibration.fingerprint.model_fingerprint` of the model, recorded for the check on load.

    Raises ValueError (before copying anything) for a layer with a recurrent state or a batch mismatch."""
    from ..cache.adapter import SlimCache, SlimCacheLayer, SlimHybridLayer, _layer_kind
    from ..compat import DummyLayer

    if not isinstance(cache, SlimCache):
        raise ValueError(f"to_state saves a SlimCache, got {type(cache).__name__}")
    for i, layer in enumerate(cache.layers):
        if isinstance(layer, SlimHybridLayer) or not isinstance(layer, (SlimCacheLayer, DummyLayer)):
            kind = getattr(layer, "layer_type", None) or _layer_kind(layer)
            raise ValueError(
                f"layer {i} is a {kind} layer with a recurrent (linear-attention / SSM) state, which prompt cache "
                f"files do not store; they store models whose layers all hold K/V"
            )
    if token_ids is not None:
        if (
            not isinstance(token_ids, torch.Tensor)
            or token_ids.ndim != 2
            or token_ids.dtype.is_floating_point
        ):
            raise ValueError(f"token_ids must be a (batch, tokens) integer tensor, got {token_ids!r:.80}")
        batch = next((s.kv_shape[0] for s in cache.stores() if s.kv_shape is not None), token_ids.shape[0])
        if token_ids.shape[0] != batch:
            raise ValueError(f"token_ids has batch {token_ids.shape[0]} but the cache holds batch {batch}")

    tensors: dict[str, torch.Tensor] = {}
    layers = []
    for i, layer in enumerate(cache.layers):
        if isinstance(layer, DummyLayer):
            layers.append({"kind": "dummy"})
            continue
        st = layer.store.state()
        entry = {
            "kind": "kv",
            "seen": int(st["seen"]),
            "base": int(st["base"]),
            "runs": st["runs"],
            "dtype": None if st["dtype"] is None else _dtype_name(st["dtype"]),
            "kv_shape": None if st["kv_shape"] is None else list(st["kv_shape"]),
            "v_dim": int(st["v_dim"]),
        }
        pre = f"layers.{i}."
        for name in ("sink_k", "sink_v", "sink_rot", "pads", "sink_start"):
            _put(tensors, pre + name, st[name])
        for role in ("k", "v"):
            body, offset, fp = st[role]
            entry[f"{role}_offset"] = int(offset)
            for part, t in body.token.items():
                _put(tensors, f"{pre}{role}.token.{part}", t)
            for part, t in body.group.items():
                _put(tensors, f"{pre}{role}.group.{part}", t)
            _put(tensors, f"{pre}{role}.residual", fp)
        layers.append(entry)
    if cache.padding_explicit:
        _put(tensors, "padding.pads", cache.pads)
    if token_ids is not None:
        _put(tensors, "token_ids", token_ids.long())

    shapes = cache._shapes
    fp_dtypes = sorted({_dtype_name(t.dtype) for n, t in tensors.items() if n.endswith(".residual")})
    header = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "cache_config": cache.cache_config.to_spec(),
        "levers": {
            "rotate": cache.rotate,
            "pre_rope": bool(cache.pre_rope),
            "positions": cache.positions,
            "residual_dtype": cache.cache_config.residual_dtype,
            "residual": cache.cache_config.residual_tokens,
            "residual_stored_as": fp_dtypes,
        },
        "mean_center": _bias_identity(cache),
        "model": {
            "fingerprint": model_fingerprint,
            **(
                {}
                if shapes is None
                else {
                    "model_type": shapes.model_type,
                    "n_layers": shapes.n_layers,
                    "n_kv_heads": shapes.n_kv_heads,
                    "k_head_dim": shapes.k_head_dim,
                    "v_head_dim": shapes.v_head_dim,
                }
            ),
        },
        "padding": {"explicit": bool(cache.padding_explicit)},
        "layers": layers,
        "tokens": None if token_ids is None else list(token_ids.shape),
    }
    header["sha256"] = content_sha256(tensors, header)
    return tensors, header


def from_state(
    tensors: dict[str, torch.Tensor],
    header: dict,
    *,
    config,
    model_fingerprint: str | None = None,
    mean_center=None,
    device: torch.device | str | None = None,
    compressed_attention: bool | None = None,
    cache_config=None,
    allow_other_model: bool = False,
    where: str = "prompt cache",
) -> Restored:
    """Build the SlimCache a :func:`to_state` described, for the model of ``config``.

    config: the model's config (required: the cache is rebuilt for it and its shapes are checked).
    model_fingerprint: the model's; a header recording another one is refused (a header with none is
        checked by shapes only). mean_center: the K bias the cache was saved with (a path, BiasSet or
        tensors; None: the path the header records); it must be the same bias (by its tensors' sha256).
        allow_other_model: as for SlimCache (a bias file calibrated for another model warns instead).
    device: where the tensors go (None: where they are). compressed_attention: as for SlimCache.
    cache_config: the settings the caller expects (a CacheConfig or spec; None: any): a file saved with
        others is refused (the bias is compared by identity, not by path).
    Raises ValueError (one line, starting with ``where``) naming what differs and what was expected."""
    from ..cache.adapter import SlimCache, SlimCacheLayer
    from ..config import parse_spec
    from ..shapes import ModelShapes

    def fail(msg: str) -> ValueError:
        return ValueError(f"{where}: {msg}")

    check_header(header, where=where)
    if config is None:
        raise fail("loading needs config=model.config (the cache is rebuilt for the model)")
    if content_sha256(tensors, header) != header["sha256"]:
        raise fail("its content does not match its checksum (a damaged or edited file)")

    # -- the model ---------------------------------------------------------------------------
    model = header["model"]
    why = _other_model(model.get("fingerprint"), model_fingerprint)
    if why:
        raise fail(why)
    shapes = ModelShapes.from_config(config)
    for key in ("model_type", "n_layers", "n_kv_heads", "k_head_dim", "v_head_dim"):
        if key in model and model[key] != getattr(shapes, key):
            raise fail(
                f"saved for another model: {key} {model[key]!r} in the file, {getattr(shapes, key)!r} for this model"
            )

    # -- the cache, rebuilt from the header's settings ---------------------------------------------
    try:
        cfg = parse_spec(header["cache_config"])
    except ValueError as e:
        raise fail(f"its cache_config {header['cache_config']!r} is not valid here ({e})") from None
    if cache_config is not None:
        check_cache_config(header, cache_config, where=where)
    bias = header.get("mean_center")
    if bias is None and mean_center is not None:
        raise fail("the cache was saved without K mean-centering, but mean_center was given")
    if bias is not None and mean_center is None:
        mean_center = bias.get("path")
        if mean_center is None:
            raise fail(
                "the cache was saved with K mean-centering from tensors given directly; pass the same bias as "
                "mean_center="
            )
        if not os.path.isfile(mean_center):
            raise fail(
                f"the cache was saved with K mean-centering bias {mean_center}, which does not exist here; pass "
                f"the same bias as mean_center="
            )
    try:
        cache = SlimCache.from_config(
            cfg.replace(mean_center=None),
            config=config,
            mean_center=mean_center,
            model_fingerprint=model_fingerprint,
            compressed_attention=compressed_attention,
            allow_other_model=allow_other_model,
        )
    except ValueError as e:
        raise fail(f"cannot rebuild its cache {header['cache_config']!r} for this model: {e}") from None
    levers = header["levers"]
    mine = {
        "rotate": cache.rotate,
        "pre_rope": bool(cache.pre_rope),
        "positions": cache.positions,
        "residual": cache.cache_config.residual_tokens,
    }
    for key, value in mine.items():
        if levers.get(key) != value:
            raise fail(
                f"saved with {key}={levers.get(key)!r}, but its settings resolve to {key}={value!r} for this model "
                f"(another model config, bias or kvslim version)"
            )
    if bias is not None:
        have = _bias_identity(cache)["bias_sha256"]
        if have != bias["bias_sha256"]:
            raise fail(
                f"saved with another K mean-centering bias (bias sha256 {bias['bias_sha256'][:16]}... recorded, "
                f"{have[:16]}... given); pass the bias it was saved with"
            )
    if len(header["layers"]) != len(cache.layers):
        raise fail(f"{len(header['layers'])} layers in the file, {len(cache.layers)} in this model's cache")

    # -- fill the fresh cache (it is returned only when every layer filled) -------------------------
    def get(name: str) -> torch.Tensor | None:
        t = tensors.get(name)
        return t if t is None or device is None else t.to(device)

    if header["padding"]["explicit"]:
        cache.set_left_padding(get("padding.pads") if "padding.pads" in tensors else None)
    for i, (entry, layer) in enumerate(zip(header["layers"], cache.layers, strict=True)):
        kind = "kv" if isinstance(layer, SlimCacheLayer) else "dummy"
        if entry["kind"] != kind:
            raise fail(
                f"layer {i} is a {entry['kind']} layer in the file, a {kind} layer in this model's cache"
            )
        if kind == "dummy" or not entry["seen"]:
            continue
        pre = f"layers.{i}."
        state = {name: get(pre + name) for name in ("sink_k", "sink_v", "sink_rot", "pads", "sink_start")}
        for role in ("k", "v"):
            token = {n.rsplit(".", 1)[1]: get(n) for n in tensors if n.startswith(f"{pre}{role}.token.")}
            group = {n.rsplit(".", 1)[1]: get(n) for n in tensors if n.startswith(f"{pre}{role}.group.")}
            state[role] = (
                Encoded(token=token, group=group),
                entry[f"{role}_offset"],
                get(f"{pre}{role}.residual"),
            )
        try:
            dtype = _dtype(entry["dtype"])
            state.update(
                seen=entry["seen"], base=entry["base"], runs=entry["runs"], dtype=dtype,
                kv_shape=tuple(entry["kv_shape"]), v_dim=entry["v_dim"],
            )  # fmt: skip
            _check_parts(layer.store, state)
            layer.store.restore(state)
        except (ValueError, KeyError, TypeError, IndexError, RuntimeError) as e:
            raise fail(f"layer {i}: {e}") from None
        like = state["pads"]
        layer.lazy_initialization(
            torch.empty(0, dtype=dtype, device=like.device), torch.empty(0, dtype=dtype, device=like.device)
        )
    token_ids = get("token_ids") if "token_ids" in tensors else None
    return Restored(cache=cache, token_ids=token_ids, header=header)


# ---------------------------------------------------------------------------------------------
# files


def save(
    cache,
    path: str | os.PathLike,
    *,
    token_ids: torch.Tensor | None = None,
    model_fingerprint: str | None = None,
    mode: int | None = None,
) -> dict:
    """Write ``cache`` to ``path`` (safetensors) atomically: a temporary file beside it, flushed, re-opened
    and checked, renamed over ``path``; a failure leaves an existing file as it was (:mod:`kvslim.atomic`,
    :class:`~kvslim.atomic.WriteError`). See :func:`to_state` for the arguments; mode: the file's exact
    permission bits (``0o600``: private from the first byte; None: as ``open()`` makes it). Returns the
    header."""
    tensors, header = to_state(cache, token_ids=token_ids, model_fingerprint=model_fingerprint)
    write_state(tensors, header, path, mode=mode)
    return header


def write_state(tensors: dict[str, torch.Tensor], header: dict, path: str | os.PathLike, *, mode=None) -> None:
    """Write a :func:`to_state` snapshot to ``path`` as :func:`save` does (atomically, checked, ``mode``).
    The snapshot holds its own CPU copies, so the cache it came from may change while this writes (a
    server's background writer)."""
    from safetensors.torch import save_file

    from ..atomic import atomic_path

    metadata = {META_KEY: json.dumps(header, sort_keys=True, separators=(",", ":"))}

    def verify(tmp) -> None:
        names, meta = _open(tmp, where=f"prompt cache {os.fspath(path)}")
        if names != set(tensors) or meta != header:
            raise ValueError(
                "the file written does not read back as the cache (tensor names or header differ)"
            )

    with atomic_path(path, verify=verify, what="prompt cache", mode=mode) as tmp:
        save_file(tensors, os.fspath(tmp), metadata=metadata)


def read_header(path: str | os.PathLike) -> dict:
    """The JSON header of a prompt cache file, checked (format, version), without reading the tensors.
    ValueError (one line naming the file) for a file that is not one this kvslim reads."""
    where = f"prompt cache {os.fspath(path)}"
    _, header = _open(path, where=where)
    return header


def load(
    path: str | os.PathLike,
    *,
    config,
    model_fingerprint: str | None = None,
    mean_center=None,
    device: torch.device | str | None = None,
    compressed_attention: bool | None = None,
    cache_config=None,
    allow_other_model: bool = False,
) -> Restored:
    """Read a prompt cache file and rebuild its cache for the model of ``config`` (:func:`from_state` for the
    arguments and the checks). ValueError (one line naming the file) for a damaged or truncated file, a file
    for another model, format, levers or bias, or a file of a newer layout version."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    where = f"prompt cache {os.fspath(path)}"
    _, header = _open(path, where=where)
    try:
        tensors = load_file(os.fspath(path), device="cpu")
    except (SafetensorError, OSError, RuntimeError, ValueError) as e:
        raise ValueError(
            f"{where}: cannot read its tensors ({_first_line(e)}): a damaged or truncated file"
        ) from None
    return from_state(
        tensors,
        header,
        config=config,
        model_fingerprint=model_fingerprint,
        mean_center=mean_center,
        device=device,
        compressed_attention=compressed_attention,
        cache_config=cache_config,
        allow_other_model=allow_other_model,
        where=where,
    )


def check_header(header, *, where: str = "prompt cache") -> None:
    """ValueError unless ``header`` is a prompt cache header this kvslim reads (format, version, fields)."""
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise ValueError(f"{where}: not a kvslim prompt cache (no {FORMAT!r} header)")
    version = header.get("version")
    if not isinstance(version, int) or version < 1:
        raise ValueError(f"{where}: layout version {version!r} is not valid (expected {FORMAT_VERSION})")
    if version > FORMAT_VERSION:
        raise ValueError(
            f"{where}: written by a newer kvslim (layout version {version}; this kvslim reads {FORMAT_VERSION}): "
            f"upgrade kvslim or prefill again"
        )
    missing = [k for k in _HEADER if not isinstance(header.get(k), _HEADER[k])]
    for i, entry in enumerate(header.get("layers") or []):
        kind = entry.get("kind") if isinstance(entry, dict) else None
        fields = {"dummy": {}, "kv": _KV_LAYER}.get(kind)
        if fields is None:
            missing.append(f"layers[{i}].kind")
            continue
        missing += [f"layers[{i}].{k}" for k in fields if not isinstance(entry.get(k), fields[k])]
    if missing:
        raise ValueError(f"{where}: the header lacks or mistypes {', '.join(missing[:4])} (a damaged file)")


#: The header's fields and their JSON types (check_header), and those of one K/V layer's entry.
_HEADER = {
    "cache_config": str,
    "levers": dict,
    "model": dict,
    "padding": dict,
    "layers": list,
    "mean_center": (dict, type(None)),
    "tokens": (list, type(None)),
    "sha256": str,
}
_KV_LAYER = {
    "seen": int,
    "base": int,
    "runs": list,
    "dtype": (str, type(None)),
    "kv_shape": (list, type(None)),
    "v_dim": int,
    "k_offset": int,
    "v_offset": int,
}


# ---------------------------------------------------------------------------------------------
# the continuation rule: can this saved cache continue this prompt?


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
        """From a prompt cache header (:func:`to_state`, :func:`read_header`). CannotContinue (kind
        ``damaged``, or ``settings`` for settings this kvslim does not know) for a header it does not read."""
        from ..config import parse_spec

        try:
            check_header(header, where=where)
        except ValueError as e:
            raise CannotContinue(str(e), "damaged") from None
        try:
            cfg = parse_spec(header["cache_config"])
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
        The checksum is verified by :func:`load`, not here."""
        from safetensors import SafetensorError, safe_open

        where = f"prompt cache {os.fspath(path)}"
        try:
            names, header = _open(path, where=where)
        except ValueError as e:
            raise CannotContinue(str(e), "damaged") from None
        token_ids = None
        if "token_ids" in names:
            try:
                with safe_open(os.fspath(path), framework="pt") as f:
                    token_ids = f.get_tensor("token_ids")
            except (SafetensorError, OSError, RuntimeError, ValueError) as e:
                raise CannotContinue(
                    f"{where}: cannot read its token ids ({_first_line(e)}): a damaged or truncated file", "damaged"
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
        ``cache_config`` the settings it was made with."""
        dtypes = {_dtype_name(s.dtype) for s in cache.stores() if s.dtype is not None}
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
       continued by a bfloat16 one — the fingerprint is the same for both, see :mod:`kvslim.calibration.fingerprint`);
    3. settings: it was saved with ``cache_config`` (a CacheConfig or spec: the same format, policy and
       levers; a K bias if and only if one is asked for — :func:`check_cache_config`);
    4. tokens: ``prompt`` ((B, T) tensor, or one row of ints) starts with its token ids and goes on past them
       (:func:`continued_prefix`: a saved cache is continued as it is, never cropped).

    Returns how many leading prompt tokens it holds (with ``prompt``; None without). Raises
    :class:`CannotContinue` (one line starting with ``where``; ``kind`` names the check) otherwise.
    Loading the file (:func:`load`) still checks what needs the tensors and the model's config: the checksum,
    shapes, resolved levers and the bias's identity."""
    why = _other_model(saved.model_fingerprint, model_fingerprint)
    if why:
        raise CannotContinue(f"{where}: {why}", "model")
    if dtype is not None:
        name = dtype if isinstance(dtype, str) else _dtype_name(dtype)
        if saved.dtypes and saved.dtypes != (name,):
            raise CannotContinue(
                f"{where}: saved from a {', '.join(saved.dtypes)} model, this one runs in {name}", "dtype"
            )
    if cache_config is not None:
        try:
            _check_settings(saved.cache_config, saved.centered, cache_config, where=where)
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
    """:func:`check_continuation` for a caller that must not raise (a server's session starts over instead):
    ``(n, None)`` when ``saved`` continues ``prompt`` holding its first ``n`` tokens, else ``(None, why)``
    (``str(why)`` the one-line reason, ``why.kind`` which check)."""
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
    from ..config import parse_spec

    _check_settings(
        parse_spec(header["cache_config"]), header.get("mean_center") is not None, cache_config, where=where
    )


def _check_settings(saved, centered: bool, cache_config, *, where: str) -> None:
    """ValueError unless ``saved`` (a CacheConfig; ``centered``: it holds mean-centered keys) are the
    settings ``cache_config`` (a CacheConfig or spec) asks for, the K bias path aside."""
    from ..config import parse_spec

    saved = saved.replace(mean_center=None)
    want = parse_spec(cache_config) if isinstance(cache_config, str) else cache_config
    if want.replace(mean_center=None) != saved:
        raise ValueError(
            f"{where}: saved with cache {saved.to_spec()!r}, expected {want.replace(mean_center=None).to_spec()!r}"
        )
    if (want.mean_center is not None) != centered:
        raise ValueError(
            f"{where}: saved {'with' if centered else 'without'} K mean-centering, expected "
            f"{'with' if want.mean_center else 'without'}"
        )


def _other_model(recorded: str | None, mine: str | None) -> str | None:
    """Why a cache recording model fingerprint ``recorded`` is not this model's (``mine``), or None."""
    if recorded and mine and recorded != mine:
        return (
            f"saved for another model: the file records model fingerprint {recorded[:23]}..., this model's is "
            f"{mine[:23]}..."
        )
    return None


def content_sha256(tensors: dict[str, torch.Tensor], header: dict) -> str:
    """sha256 over the header (all but its ``sha256`` field, as sorted compact JSON) and every tensor's name,
    dtype, shape and bytes, in sorted name order: ``sha256:<hex>``."""
    h = hashlib.sha256()
    rest = {k: v for k, v in header.items() if k != "sha256"}
    h.update(json.dumps(rest, sort_keys=True, separators=(",", ":")).encode())
    for name in sorted(tensors):
        t = tensors[name]
        h.update(f"{name}:{_dtype_name(t.dtype)}:{tuple(t.shape)};".encode())
        h.update(t.detach().to("cpu").contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return "sha256:" + h.hexdigest()


# ---------------------------------------------------------------------------------------------
# helpers


def _open(path, *, where: str) -> tuple[set[str], dict]:
    """(tensor names, checked header) of a safetensors file; ValueError naming ``where``."""
    from safetensors import SafetensorError, safe_open

    if not os.path.isfile(path):
        raise ValueError(f"{where}: no such file")
    try:
        with safe_open(os.fspath(path), framework="pt") as f:
            names, meta = set(f.keys()), f.metadata() or {}
    except (SafetensorError, OSError, RuntimeError, ValueError) as e:
        raise ValueError(
            f"{where}: not a readable safetensors file ({_first_line(e)}): damaged or truncated"
        ) from None
    if META_KEY not in meta:
        raise ValueError(f"{where}: a safetensors file without a kvslim prompt cache header")
    try:
        header = json.loads(meta[META_KEY])
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: its header is not JSON ({e.msg}): a damaged file") from None
    check_header(header, where=where)
    return names, header


def _check_parts(store, state: dict) -> None:
    """ValueError unless each stream's encoded parts are what the layer's codec writes: the same part names
    (plus ``centered`` where keys are centered per token), trailing shapes and dtypes (a probe encode)."""
    from ..cache.buffers import CENTERED

    dims = {"k": state["kv_shape"][2], "v": state["v_dim"]}
    for role in ("k", "v"):
        body = state[role][0]
        if not body.token and not body.group:
            continue
        codec = getattr(store, role).codec
        probe = codec.encode(torch.zeros(1, 1, codec.token_group, dims[role], dtype=state["dtype"]))
        for kind, want, got in (("token", probe.token, body.token), ("group", probe.group, body.group)):
            extra = set(got) - set(want) - ({CENTERED} if kind == "token" else set())
            if set(want) - set(got) or extra:
                raise ValueError(
                    f"{role} {kind} parts {sorted(got)} are not what {codec.name} writes ({sorted(want)})"
                )
            for name, t in want.items():
                g = got[name]
                if g.dtype != t.dtype or tuple(g.shape[3:]) != tuple(t.shape[3:]):
                    raise ValueError(
                        f"{role} {kind} part {name!r} is {_dtype_name(g.dtype)} {tuple(g.shape[3:])} per entry, but "
                        f"{codec.name} writes {_dtype_name(t.dtype)} {tuple(t.shape[3:])}"
                    )


def _put(tensors: dict, name: str, t: torch.Tensor | None) -> None:
    """Store a contiguous CPU copy of ``t`` (views into live buffers change at the cache's next update)."""
    if t is not None:
        tensors[name] = torch.empty(t.shape, dtype=t.dtype).copy_(t.detach())


def _bias_identity(cache) -> dict | None:
    """The K mean-centering bias a cache uses: its file path and the file's sha256 (when it came from a
    file) and the sha256 of the per-layer bias tensors (what loading compares); None without a bias."""
    biases = cache._biases
    if biases is None:
        return None
    h = hashlib.sha256()
    for t in biases:
        h.update(t.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    path = cache.cache_config.mean_center
    file_sha = None
    if path is not None and os.path.isfile(path):
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
        file_sha = "sha256:" + digest.hexdigest()
    return {"path": path, "file_sha256": file_sha, "bias_sha256": "sha256:" + h.hexdigest()}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(name: str | None) -> torch.dtype | None:
    if name is None:
        return None
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__
