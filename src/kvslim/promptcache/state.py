"""A cache's state: what is captured from a cache, and how a fresh cache is rebuilt and filled from it.

:func:`to_state` gives ``(tensors, header)`` — contiguous CPU copies of every stored tensor (nothing is
decoded or re-quantized) and the JSON-able header of :mod:`kvslim.promptcache` — and :func:`from_state`
builds the cache back for the caller's model; :func:`save` / :func:`load` add the file (:mod:`.files`).

The cache is an argument, read through a small protocol (:class:`SavableCache`), and a fresh one is made by
the caller's builder (``new_cache``, e.g. :meth:`kvslim.SlimCache.from_config`): this module does not import
the cache adapter (:mod:`kvslim.cache.adapter`), whose ``save`` / ``load`` call it, so the dependency runs
one way. It reads each layer's store (:class:`kvslim.cache.layer.SlimLayer`) through its own ``state()`` /
``restore()``.

Loading checks that the rebuilt cache resolves the same levers and that the model and bias are the ones
recorded, and fills its layers through their own appends: a failed load builds nothing the caller sees.
Layers with a recurrent state (linear attention, SSM hybrids) are refused: their state is not stored in
these files (yet). Whether a saved cache may continue a prompt is not decided here (:mod:`.continuation`).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from ..formats import Encoded
from .continuation import check_cache_config, other_model, saved_config
from .files import open_file, read_tensors, where_of, write_state
from .header import FORMAT, FORMAT_VERSION, check_header, content_sha256, dtype_name, parse_dtype


class SavableCache(Protocol):
    """What this module reads of a cache (a :class:`kvslim.SlimCache` is one).

    ``layers``: per model layer, a K/V layer whose ``store`` is a :class:`~kvslim.cache.layer.SlimLayer`, a
    KV-sharing ``DummyLayer``, or a recurrent layer (refused); ``stores()``: the SlimLayers; the settings
    ``cache_config`` (a CacheConfig) and what they resolved to (``rotate``, ``pre_rope``, ``positions``); the
    left padding handed over (``padding_explicit``, ``pads``, ``set_left_padding``); the model's shapes
    (``_shapes``: a ModelShapes or None) and the K bias tensors (``_biases``: per layer, or None)."""

    layers: list
    cache_config: object
    rotate: str
    pre_rope: bool
    positions: str
    padding_explicit: bool
    pads: torch.Tensor | None
    _shapes: object
    _biases: list | None

    def stores(self) -> list: ...

    def set_left_padding(self, pads: torch.Tensor | None) -> None: ...


#: new_cache(cache_config, *, config, mean_center, model_fingerprint, compressed_attention, allow_other_model)
#: -> an empty cache for the model of ``config`` (what :meth:`kvslim.SlimCache.from_config` takes).
CacheBuilder = Callable[..., SavableCache]


@dataclass
class Restored:
    """A loaded prompt cache: the ``cache``, the ``token_ids`` (B, T) int64 it was filled with (None when
    the file has none) and the file's ``header``."""

    cache: object  # what new_cache built (a SlimCache)
    token_ids: torch.Tensor | None
    header: dict


def to_state(
    cache: SavableCache, *, token_ids: torch.Tensor | None = None, model_fingerprint: str | None = None
) -> tuple[dict[str, torch.Tensor], dict]:
    """A cache as ``(tensors, header)``: contiguous CPU copies of every stored tensor, and the JSON-able
    header of :mod:`kvslim.promptcache`. token_ids: (B, T) the ids the cache was filled with (stored as
    given); model_fingerprint: :func:`kvslim.calibration.fingerprint.model_fingerprint` of the model, recorded
    for the check on load.

    Raises ValueError (before copying anything) for a layer with a recurrent state or a batch mismatch."""
    if not (callable(getattr(cache, "stores", None)) and hasattr(cache, "layers") and hasattr(cache, "cache_config")):
        raise ValueError(f"to_state saves a SlimCache, got {type(cache).__name__}")
    kinds = [_layer_kind(layer) for layer in cache.layers]
    for i, kind in enumerate(kinds):
        if kind not in ("kv", "dummy"):
            raise ValueError(
                f"layer {i} is a {kind} layer with a recurrent (linear-attention / SSM) state, which prompt cache "
                f"files do not store; they store models whose layers all hold K/V"
            )
    if token_ids is not None:
        if not isinstance(token_ids, torch.Tensor) or token_ids.ndim != 2 or token_ids.dtype.is_floating_point:
            raise ValueError(f"token_ids must be a (batch, tokens) integer tensor, got {token_ids!r:.80}")
        batch = next((s.kv_shape[0] for s in cache.stores() if s.kv_shape is not None), token_ids.shape[0])
        if token_ids.shape[0] != batch:
            raise ValueError(f"token_ids has batch {token_ids.shape[0]} but the cache holds batch {batch}")

    tensors: dict[str, torch.Tensor] = {}
    layers = []
    for i, (layer, kind) in enumerate(zip(cache.layers, kinds, strict=True)):
        if kind == "dummy":
            layers.append({"kind": "dummy"})
            continue
        st = layer.store.state()
        entry = {
            "kind": "kv",
            "seen": int(st["seen"]),
            "base": int(st["base"]),
            "runs": st["runs"],
            "dtype": None if st["dtype"] is None else dtype_name(st["dtype"]),
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
    fp_dtypes = sorted({dtype_name(t.dtype) for n, t in tensors.items() if n.endswith(".residual")})
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
            "sink": cache.cache_config.sink_tokens,
            "residual_stored_as": fp_dtypes,
            "varnorm": cache.report()["varnorm"],
            "clip": cache.report()["clip"],
            "codebook": cache.report()["codebook"],
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
    new_cache: CacheBuilder,
    model_fingerprint: str | None = None,
    mean_center=None,
    device: torch.device | str | None = None,
    compressed_attention: bool | None = None,
    cache_config=None,
    allow_other_model: bool = False,
    where: str = "prompt cache",
) -> Restored:
    """Build the cache a :func:`to_state` described, for the model of ``config``.

    config: the model's config (required: the cache is rebuilt for it and its shapes are checked).
    new_cache: builds the empty cache to fill (:data:`CacheBuilder`: ``SlimCache.from_config``).
    model_fingerprint: the model's; a header recording another one is refused (a header with none is
        checked by shapes only). mean_center: the K bias the cache was saved with (a path, BiasSet or
        tensors; None: the path the header records); it must be the same bias (by its tensors' sha256).
        allow_other_model: as for SlimCache (a bias file calibrated for another model warns instead).
    device: where the tensors go (None: where they are). compressed_attention: as for SlimCache.
    cache_config: the settings the caller expects (a CacheConfig or spec; None: any): a file saved with
        others is refused (the bias is compared by identity, not by path).
    Raises ValueError (one line, starting with ``where``) naming what differs and what was expected."""
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
    why = other_model(model.get("fingerprint"), model_fingerprint)
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
        cfg = saved_config(header)
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
        cache = new_cache(
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
        "sink": cache.cache_config.sink_tokens,
        "varnorm": cache.report()["varnorm"],
        "clip": cache.report()["clip"],
        "codebook": cache.report()["codebook"],
    }
    for key, value in mine.items():
        # (a file written before varnorm was recorded: its parts are checked against the codec below; one
        # written before clip was: clipping changes only how later tokens are encoded, not how these read; one
        # written before codebook was holds uniform codes: "none", so a cache that reads a level table refuses it)
        # (one written before sink was recorded: saved_config pinned its sinks to the 0 it meant)
        saved = levers.get(key, value if key in ("varnorm", "clip", "sink") else "none" if key == "codebook" else None)
        if saved != value:
            raise fail(
                f"saved with {key}={saved!r}, but its settings resolve to {key}={value!r} for this model "
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
        kind = _layer_kind(layer)
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
            dtype = parse_dtype(entry["dtype"])
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


def save(
    cache: SavableCache,
    path: str | os.PathLike,
    *,
    token_ids: torch.Tensor | None = None,
    model_fingerprint: str | None = None,
    mode: int | None = None,
) -> dict:
    """Write ``cache`` to ``path`` (safetensors) atomically (:func:`~.files.write_state`: a temporary beside
    it, checked, renamed; ``mode`` the file's permission bits). See :func:`to_state` for the arguments.
    Returns the header."""
    tensors, header = to_state(cache, token_ids=token_ids, model_fingerprint=model_fingerprint)
    write_state(tensors, header, path, mode=mode)
    return header


def load(
    path: str | os.PathLike,
    *,
    config,
    new_cache: CacheBuilder,
    model_fingerprint: str | None = None,
    mean_center=None,
    device: torch.device | str | None = None,
    compressed_attention: bool | None = None,
    cache_config=None,
    allow_other_model: bool = False,
) -> Restored:
    """Read a prompt cache file and rebuild its cache for the model of ``config`` with ``new_cache``
    (``SlimCache.from_config``; :func:`from_state` for the arguments and the checks). ValueError (one line
    naming the file) for a damaged or truncated file, a file for another model, format, levers or bias, or a
    file of a newer layout version."""
    where = where_of(path)
    _, header = open_file(path, where=where)
    tensors = read_tensors(path, where=where)
    return from_state(
        tensors,
        header,
        config=config,
        new_cache=new_cache,
        model_fingerprint=model_fingerprint,
        mean_center=mean_center,
        device=device,
        compressed_attention=compressed_attention,
        cache_config=cache_config,
        allow_other_model=allow_other_model,
        where=where,
    )


# ---------------------------------------------------------------------------------------------
# helpers


def _layer_kind(layer) -> str:
    """``"kv"`` (its ``store`` is a SlimLayer), ``"dummy"`` (KV-sharing: nothing stored), or what the layer
    is (``"linear_attention"``, or its type's name): a layer these files do not store."""
    from ..cache.layer import SlimLayer
    from ..compat import DummyLayer, LinearAttentionCacheLayerMixin

    if isinstance(layer, DummyLayer):
        return "dummy"
    if isinstance(layer, LinearAttentionCacheLayerMixin):
        return getattr(layer, "layer_type", None) or "linear_attention"
    if isinstance(getattr(layer, "store", None), SlimLayer):
        return "kv"
    return getattr(layer, "layer_type", None) or type(layer).__name__


def _check_parts(store, state: dict) -> None:
    """ValueError unless each stream's encoded parts are what the layer's codec writes: the same part names
    (plus ``centered`` where keys are centered per token), trailing shapes and dtypes (a probe encode)."""
    from ..cache.basis import CENTERED

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
                        f"{role} {kind} part {name!r} is {dtype_name(g.dtype)} {tuple(g.shape[3:])} per entry, but "
                        f"{codec.name} writes {dtype_name(t.dtype)} {tuple(t.shape[3:])}"
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
