"""Building a SlimCache: its options resolved against the model, and the store and layer of each model layer.

:func:`resolve_storage` turns a validated :class:`~kvslim.config.CacheConfig` and the model's config into
:class:`Storage`, every storage decision of a cache made once: the keep policy, the codecs (and those of the
layers ``keep_layers`` names), the low-bit levers with ``auto`` resolved (:mod:`kvslim.cache.levers`), the
mean-centering biases read and checked, the model's RoPE and the position semantics in effect.
:func:`layer_storage` and :func:`new_store` give model layer ``i`` its store; :func:`new_layer` the
transformers layer that holds it (:func:`layer_plan`: the model's layer types, refused with one line where
SlimCache cannot serve them).

This module knows nothing about the attention implementation, the decode loop or files; it reads bias files
only through :mod:`kvslim.calibration.meancenter`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .. import compat
from ..compat import DummyLayer, LinearAttentionLayer  # by release: see compat
from ..config import CacheConfig
from ..formats import Codec
from ..formats.varnorm import cache_codec
from ..shapes import ModelShapes, text_config
from .hadamard import Hadamard
from .layer import SlimLayer
from .layer_adapter import HYBRID_TYPES, LINEAR_TYPES, SUPPORTED_TYPES, SlimCacheLayer, SlimHybridLayer
from .levers import model_rotary, resolve_levers
from .policy import KeepPolicy
from .positions import rebase_period
from .rotary import Rotary

#: residual_dtype -> what a Stream is told (None: the model's dtype; "auto": decided per tensor dtype)
_FP_DTYPES = {"auto": "auto", "model": None, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class Storage:
    """Every storage decision of one cache (module docstring), ``auto`` resolved.

    policy: the keep policy of full-attention layers; codecs: ``{"k": ..., "v": ...}``; keep_codecs: those of
    the layers ``keep_layers`` names (None: no layer is kept apart); kept_layers: their indices; shapes: the
    model's attention geometry (None without ``config``); hadamard: ``{"k", "v"}`` -> the rotation of each
    encoded tensor or None; rope_source: pre-RoPE's rotary source (None: keys stored after RoPE); rotate:
    ``"none"``, ``"k"``, ``"v"`` or ``"kv"``; pre_rope: whether the K stream holds keys before RoPE; biases:
    the per-layer mean-centering bias (H_kv, D) or None; rotary: the model's RoPE where keys can be moved
    (None otherwise); positions: ``"cache"`` or ``"original"``; rebase_period: how often kvslim's loop
    re-bases position ids (None: never).
    """

    policy: KeepPolicy
    codecs: dict[str, Codec]
    keep_codecs: dict[str, Codec] | None
    kept_layers: frozenset[int]
    shapes: ModelShapes | None
    hadamard: dict[str, Hadamard | None]
    rope_source: object | None
    rotate: str
    pre_rope: bool
    biases: list[torch.Tensor] | None
    rotary: Rotary | None
    positions: str
    rebase_period: int | None


def resolve_storage(
    cfg: CacheConfig,
    *,
    config,
    mean_center,
    observe_stored: bool,
    model_fingerprint: str | None,
    allow_other_model: bool,
) -> Storage:
    """Resolve ``cfg`` against the model of ``config`` (None: no model known); ``mean_center`` as given to
    :class:`~kvslim.SlimCache` (a path, a BiasSet or tensors). ValueError, with one line, for a combination the
    model or the formats cannot serve."""
    policy = KeepPolicy(sink=cfg.sink_tokens, window=cfg.window)
    codecs = {"k": cache_codec(cfg, cfg.k_format, "k"), "v": cache_codec(cfg, cfg.v_format, "v")}
    keep_codecs = None
    shapes = None
    kept_layers: frozenset[int] = frozenset()
    if cfg.keep_layers:
        if config is None:
            raise ValueError(
                f"keep_layers={cfg.keep_layers} needs config=model.config (the model's number of layers)"
            )
        keep_codecs = {
            role: cache_codec(cfg, fmt, role) for role, fmt in zip("kv", cfg.keep_formats, strict=True)
        }
    if config is not None:
        shapes = model_shapes(config)
        kept_layers = cfg.kept_layers(shapes.n_layers)  # one line for an index out of range
        checks = [(f"{role}_quantize", role, codec) for role, codec in codecs.items()]
        checks += [("keep_format", role, codec) for role, codec in (keep_codecs or {}).items()]
        for what, role, codec in checks:
            try:
                codec.check_head_dim(shapes.k_head_dim if role == "k" else shapes.v_head_dim)
            except ValueError as e:
                raise ValueError(f"{what}={codec.name!r} cannot store this model's KV: {e}") from None
    # The low-bit levers in effect, "auto" resolved (docs/quality.md, "Low-bit levers"):
    hadamard, rope_source = resolve_levers(cfg, config, shapes, codecs, mean_center)
    plain_roles = [r for r in "kv" if hadamard[r] is not None and not codecs[r].lossy]
    if plain_roles and not observe_stored:  # (observe_stored: calibration observes keys in that basis)
        rest = "".join(r for r in cfg.rotate if r in "kv" and r not in plain_roles) or "none"
        names = " and ".join(f"{r}_quantize='none'" for r in plain_roles)
        raise ValueError(
            f"rotate={cfg.rotate!r} with {names}: only encoded (quantized) tensors are stored rotated, so "
            f"nothing would be; use rotate={rest!r} or quantize {' and '.join(r.upper() for r in plain_roles)}"
        )
    rotate = {(False, False): "none", (True, False): "k", (False, True): "v", (True, True): "kv"}[
        (hadamard["k"] is not None, hadamard["v"] is not None)
    ]
    if cfg.rotate == "fitted":
        rotate = "fitted"
    pre_rope = rope_source is not None
    biases = None
    if mean_center is not None and cfg.rotate == "fitted":
        biases = _fitted_biases(cfg, shapes, codecs, hadamard, mean_center, pre_rope, model_fingerprint, allow_other_model)
    elif mean_center is not None:
        biases = _load_biases(
            cfg, shapes, mean_center, hadamard["k"] is not None, pre_rope, model_fingerprint, allow_other_model
        )
    rotary, why = (None, "no config=model.config") if config is None else model_rotary(config)
    # the position semantics in effect ("auto" resolved: "cache" wherever keys can be moved)
    positions = cfg.positions if cfg.positions != "auto" else ("cache" if rotary else "original")
    if cfg.positions == "cache" and cfg.window is not None and rotary is None:
        raise ValueError(
            f"positions='cache' re-rotates the sink keys, which needs the model's RoPE: {why}; "
            f"use positions='original'"
        )
    # kvslim's loop re-bases position ids every this many tokens (None: never), see generate.py.
    # (None before transformers 5.24: the cache could not read the base back from the ids, see compat)
    period = rebase_period(policy, rotary) if compat.POSITIONS_REACH_CACHE else None
    return Storage(
        policy=policy,
        codecs=codecs,
        keep_codecs=keep_codecs,
        kept_layers=kept_layers,
        shapes=shapes,
        hadamard=hadamard,
        rope_source=rope_source,
        rotate=rotate,
        pre_rope=pre_rope,
        biases=biases,
        rotary=rotary,
        positions=positions,
        rebase_period=period,
    )


def _fitted_biases(cfg, shapes, codecs, rotations, mean_center, pre_rope, model_fingerprint, allow_other_model):
    """``rotate='fitted'``: the file checked against the model as a bias file is (fingerprint, shapes, the
    pre-RoPE basis its rotations were fitted in), and its K means, taken to the fitted basis, where the K format
    centers (None otherwise: the file serves the rotation only)."""
    from ..calibration.biasfile import read_layers
    from ..calibration.meancenter import BiasSet
    from ..calibration.rotation import bias_to_fitted

    meta = mean_center.metadata() if isinstance(mean_center, BiasSet) else read_layers(mean_center)[1]
    # k_rot: the means' recorded basis (taken to the fitted one below); pre_rope: the rotations were fitted in
    # the file's basis, so a cache in another is refused
    biases = _load_biases(
        cfg, shapes, mean_center, bool(meta.get("k_rot")), pre_rope, model_fingerprint, allow_other_model
    )
    if not (codecs["k"].lossy and codecs["k"].format.mean_center) or rotations["k"] is None:
        return None
    k_rot = bool(meta.get("k_rot"))
    return [bias_to_fitted(b, rotations["k"].for_layer(il), k_rot) for il, b in enumerate(biases)]


def _load_biases(cfg, shapes, mean_center, k_rot, pre_rope, model_fingerprint, allow_other_model):
    """The K bias of every layer, checked against the model (:func:`~kvslim.calibration.meancenter.load_mean_center`)
    in the basis ``k_rot`` / ``pre_rope`` names."""
    if shapes is None:
        raise ValueError("mean_center needs config=model.config to check the bias against the model's shapes")
    from ..calibration.meancenter import load_mean_center

    return load_mean_center(
        mean_center,
        n_layers=shapes.n_layers,
        n_kv_heads=shapes.n_kv_heads,
        head_dim=shapes.head_dim,
        model_fingerprint=model_fingerprint,
        allow_other_model=allow_other_model,
        model_type=shapes.model_type,
        k_format=cfg.k_format,
        k_rot=k_rot,
        pre_rope=pre_rope,
    )


def layer_storage(storage: Storage, layer_idx: int) -> tuple:
    """``(k codec, v codec, k Hadamard, v Hadamard, k bias, pre_rope)`` of model layer ``layer_idx``: the
    cache's, or for a layer ``keep_layers`` names its ``keep_format`` codecs, with the cache's Hadamard rotation
    and pre-RoPE K where they are quantized (not ``none`` or fp16/bf16: there a rotation only adds rounding,
    and a kept ``none`` layer stays exactly the plain cache's), and the K bias where its K format takes one
    in the same basis (None otherwise: nothing held that is not used)."""
    bias = None if storage.biases is None else storage.biases[layer_idx]
    if layer_idx not in storage.kept_layers:
        codecs, had = storage.codecs, storage.hadamard
        return codecs["k"], codecs["v"], *_at(had, layer_idx), bias, storage.pre_rope
    codecs = storage.keep_codecs
    quantized = {role: codecs[role].lossy and codecs[role].family != "cast" for role in ("k", "v")}
    had = {role: storage.hadamard[role] if quantized[role] else None for role in ("k", "v")}
    k = codecs["k"]
    if not (k.lossy and k.format.mean_center and had["k"] is storage.hadamard["k"]):
        bias = None
    return k, codecs["v"], *_at(had, layer_idx), bias, storage.pre_rope and quantized["k"]


def _at(had: dict, layer_idx: int) -> tuple:
    """(K rotation, V rotation) of model layer ``layer_idx``: a Hadamard serves every layer, a fitted rotation is
    per layer (``for_layer``)."""
    return tuple(None if had[r] is None else had[r].for_layer(layer_idx) for r in ("k", "v"))


def new_store(storage: Storage, cfg: CacheConfig, layer_idx: int, policy: KeepPolicy) -> SlimLayer:
    """A fresh store for model layer ``layer_idx`` keeping tokens by ``policy``."""
    k_codec, v_codec, k_hadamard, v_hadamard, bias, pre_rope = layer_storage(storage, layer_idx)
    return SlimLayer(
        policy,
        k_codec,
        v_codec,
        cfg.residual_tokens,
        cfg.group_size,
        k_bias=bias,
        positions=storage.positions,
        rotary=storage.rotary,
        fp_dtype=_FP_DTYPES[cfg.residual_dtype],
        k_hadamard=k_hadamard,
        v_hadamard=v_hadamard,
        pre_rope=pre_rope,
    )


def new_layer(owner, i: int, layer_type: str, kwargs: dict):
    """The cache layer for model layer ``i`` of transformers' ``layer_type``, its store built by
    ``owner._new_store(i, policy)`` (``owner``: the SlimCache the layer asks for padding and the attention path)."""
    if layer_type in LINEAR_TYPES:
        return LinearAttentionLayer(**kwargs)  # recurrent / conv state, kept exactly as transformers keeps it
    if layer_type == "dummy":
        return DummyLayer()  # reads another layer's K/V (KV sharing) or has no attention: holds nothing
    # The model's own window bounds sliding and chunked layers (transformers keeps the last window - 1
    # tokens); StreamingLLM's sinks + window apply to full-attention layers only.
    window = kwargs.get("sliding_window")
    policy = owner.policy if window is None else KeepPolicy(sink=0, window=max(1, int(window) - 1))
    factory = functools.partial(owner._new_store, i, policy)
    if layer_type in HYBRID_TYPES:
        return SlimHybridLayer(factory, owner, i, layer_type, kwargs.get("number_of_states", 1))
    return SlimCacheLayer(factory, owner, i, layer_type)


def model_shapes(config) -> ModelShapes:
    """The model's attention geometry (raises ValueError for a config that is not a decoder LM's)."""
    return ModelShapes.from_config(config)


def layer_plan(config) -> list[tuple[str, dict]]:
    """(layer type, layer kwargs) per model layer, as transformers' own cache would build them; a clear
    error naming any layer type SlimCache cannot serve."""
    try:
        layer_types, kwargs = compat.layer_types_and_kwargs(text_config(config))
    except ValueError as e:
        raise ValueError(
            f"cannot read the layer types of {ModelShapes.from_config(config).model_type}: {e}"
        ) from None
    unsupported = sorted({t for t in layer_types if t not in SUPPORTED_TYPES})
    if unsupported:
        raise ValueError(
            f"{ModelShapes.from_config(config).model_type} has {', '.join(unsupported)} layers, which SlimCache does not "
            f"serve; it serves {', '.join(SUPPORTED_TYPES)} (use transformers' DynamicCache for this model)"
        )
    return list(zip(layer_types, kwargs, strict=True))
