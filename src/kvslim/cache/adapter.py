"""SlimCache: the transformers adapter. The ONLY module that imports transformers' Cache API.

Usage::

    from kvslim import SlimCache
    cache = SlimCache(kv_quantize="int4", sink=4, window=1020, config=model.config)
    out = model.generate(**inputs, past_key_values=cache)      # or model(..., cache=cache)

Everything about storage lives in :mod:`kvslim.cache.layer`, everything about which tokens are kept in
:mod:`kvslim.cache.policy`, every format in :mod:`kvslim.formats`. This module maps transformers' per-layer
contract (``update``, ``get_seq_length``, ``get_mask_sizes``, ``reorder_cache``, ``crop``, ...)
onto them.

Masking after eviction: a layer holding ``stored`` of ``seen`` tokens reports
``get_mask_sizes(q) = (stored + q, seen - stored)``, i.e. its stored tokens are presented as if
they were the ``stored`` positions just before the new ones. All of them precede every new query,
so the causal mask shows them all and stays causal among the new tokens; and because of the
sink rule in :mod:`kvslim.cache.policy`, the padding mask read at those positions is exactly right for
left-padded batches too.

Left padding — the convention, written once here. Row ``b`` of a batch carries ``pads[b]`` pad tokens
before its first real token; StreamingLLM must keep each row's first *real* tokens as sinks. kvslim's
own loop (:mod:`kvslim.generate`) reads the padding from the attention mask at prefill and hands it
over once with :meth:`SlimCache.set_left_padding`. When nobody did (``model.generate()``), the padding
is derived from transformers' convention at each update: ``generate()`` gives left-padded rows
position ids that count real tokens only, so the newest token's position falls short of
``seen - 1`` by the row's pads. A caller with another convention must hand the padding explicitly.
"""

from __future__ import annotations

import functools
import os
import warnings
import weakref

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .. import attention, compat
from ..compat import (  # by release: see compat
    DummyLayer,
    LinearAttentionCacheLayerMixin,
    LinearAttentionLayer,
)
from ..config import (
    DEFAULT_GROUP_SIZE,
    DEFAULT_KEEP_FORMAT,
    DEFAULT_POSITIONS,
    DEFAULT_PRE_ROPE,
    DEFAULT_RESIDUAL_DTYPE,
    DEFAULT_ROTATE,
    CacheConfig,
)
from ..formats import make_codec
from ..shapes import ModelShapes, is_mla, text_config
from .layer import SlimLayer
from .levers import model_rotary, resolve_levers
from .policy import KeepPolicy
from .positions import base_from_positions, max_position, pads_from_positions, rebase_period


class SlimCacheLayer(CacheLayerMixin):
    """transformers' per-layer contract over a :class:`~kvslim.cache.layer.SlimLayer`."""

    is_compileable = False
    is_sliding = False

    def __init__(self, store_factory, owner: SlimCache, layer_idx: int, layer_type: str = "full_attention"):
        super().__init__()
        self._factory = store_factory
        self._owner = owner  # the cache: padding, attention path and observer are decided there
        self.layer_idx = layer_idx
        self.layer_type = layer_type
        self.is_sliding = layer_type in SLIDING_TYPES  # transformers reads it for masks and offloading
        self.store: SlimLayer = store_factory()

    @property
    def is_croppable(self) -> bool:
        """Whether :meth:`crop` can undo what transformers rolls back (assisted decoding asks once, after
        the prefill): nothing is ever evicted (no window) and the newest tokens stay at full precision (a
        residual, or formats that store tokens as given). A crop past the residual is refused."""
        store = self.store
        if store.policy.bounded or store.stored < store.seen:
            return False
        lossy = store.k.codec.lossy or store.v.codec.lossy
        return not lossy or self._owner.cache_config.residual_tokens > 0

    # transformers' layers hold `keys` / `values` tensors that its code and users read (DynamicCache's
    # __iter__, output-shape checks). Here they are computed from the store on each read.
    @property
    def keys(self) -> torch.Tensor | None:
        """Every stored key, oldest first, decoded to the model's dtype: ``(B, H_kv, stored, D)``; None before
        the first update. Computed on each read (a lossy format: the values attention sees; ``none``: the
        stored values). Read-only."""
        return self._decoded(0)

    @keys.setter
    def keys(self, value) -> None:
        _refuse_assignment("keys", value)

    @property
    def values(self) -> torch.Tensor | None:
        """Every stored value, as :attr:`keys`: ``(B, H_kv, stored, D_v)`` or None. Read-only."""
        return self._decoded(1)

    @values.setter
    def values(self, value) -> None:
        _refuse_assignment("values", value)

    def _decoded(self, which: int) -> torch.Tensor | None:
        store = getattr(self, "store", None)  # CacheLayerMixin.__init__ assigns None before the store exists
        if store is None or not self.is_initialized or not store.stored:
            return None
        return store.read(self.dtype)[which]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.dtype = key_states.dtype
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        owner = self._owner
        if owner._may_warn_materializing and not owner.compressed_attention and not _materializing_warned:
            _warn_materializing(owner)
        if owner.observe is not None and not owner.observe_stored:
            owner.observe(self.layer_idx, key_states, value_states)
        # transformers passes the attention layer's kwargs as `kwargs=...`.
        position_ids = compat.update_position_ids(kwargs)
        store = self.store
        if owner.padding_explicit:
            pads = owner.pads
            base = owner._forward_base(position_ids, pads, store.seen, key_states.shape[2], key_states.shape[0])
        else:
            pads = None
            if position_ids is not None and owner.policy.bounded and owner.policy.sink:
                pads = pads_from_positions(position_ids, store.seen, key_states)
            elif owner.policy.bounded and owner.policy.sink:
                compat.warn_padding_unseen(key_states.shape[0])  # before 5.24 the ids never get here
            base = 0  # the convention's pads make every row's offset 0
        if base != store.base and store.stored and store.rotary is None:
            raise ValueError(
                f"position ids moved by {base - store.base} against the tokens seen, and this model's keys "
                f"cannot be re-rotated: feed consecutive position ids"
            )
        if pads is not None and store.stored < store.seen and store.pads is not None:
            old = store.pads.to(pads.device)
            if old.shape == pads.shape and not torch.equal(old, pads):
                raise ValueError(
                    f"the position ids imply left padding {pads.tolist()} but this cache was filled with "
                    f"{old.tolist()} and has evicted tokens since: feed ids that count real tokens from 0 (as "
                    f"model.generate() does) or hand the padding with cache.set_left_padding() before the first token"
                )
        if pads is not None or owner.padding_explicit:
            store.set_pads(pads)
        rope = None
        if store.pre_rope:  # the forward's own RoPE (dynamic NTK's follows the longest position fed)
            rope = owner._rope_source.at(max_position(position_ids, store, key_states.shape[2], base))
        if owner.observe is not None and owner.observe_stored:
            owner.observe(self.layer_idx, store.basis_keys(key_states, base=base, rope=rope), value_states)
        compressed = owner.compressed_attention and key_states.shape[2] <= attention.FAST_MAX_QUERY
        out = store.append(key_states, value_states, segments=compressed, base=base, rope=rope)
        return (out, out) if compressed else out  # kvslim_attention reads both from the one view

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        query_length = compat.mask_query_length(query_length)  # before 5.4: cache_position
        stored = self.store.stored
        return stored + query_length, self.store.seen - stored

    def get_seq_length(self) -> int:
        return self.store.seen

    def get_max_length(self) -> int:
        # transformers' convention: a sliding layer's maximum is its window, an unbounded one's -1
        return self.store.policy.window + 1 if self.is_sliding else -1

    get_max_cache_shape = get_max_length  # its name before transformers 5.13

    def reset(self) -> None:
        self.store = self._factory()
        self.is_initialized = False

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.store.seen:
            self.store.map_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def crop(self, tokens_to_remove: int) -> None:
        # transformers' convention (DynamicLayer): a negative value removes that many tokens.
        if tokens_to_remove > 0:
            raise ValueError(
                f"crop({tokens_to_remove}): pass a negative number of tokens to remove, as with DynamicCache"
            )
        self.store.crop(-tokens_to_remove)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.store.seen:
            self.store.map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.store.seen:
            self.store.map_batch(lambda t: t[indices])

    def offload(self):
        raise ValueError(_NO_OFFLOADING)

    def prefetch(self):
        raise ValueError(_NO_OFFLOADING)


_NO_OFFLOADING = (
    "SlimCache does not offload layers to the CPU (its compressed store stays on the model's device); "
    "use a smaller format or a StreamingLLM window to save device memory"
)


def _refuse_assignment(name: str, value) -> None:
    if value is not None:  # CacheLayerMixin.__init__ assigns None
        raise AttributeError(
            f"SlimCacheLayer.{name} is computed from the compressed store and cannot be assigned"
        )


class SlimHybridLayer(LinearAttentionLayer, SlimCacheLayer):
    """A layer with both a linear-attention (SSM / conv) state and attention K/V (Falcon-H1's
    ``hybrid`` layers): the recurrent state is kept exactly as transformers' own layer keeps it, the
    K/V in a :class:`~kvslim.cache.layer.SlimLayer`."""

    def __init__(
        self, store_factory, owner: SlimCache, layer_idx: int, layer_type: str, number_of_states: int = 1
    ):
        SlimCacheLayer.__init__(self, store_factory, owner, layer_idx, layer_type)
        LinearAttentionLayer.__init__(self, number_of_states=number_of_states)

    def lazy_initialization(self, *args, **kwargs) -> None:
        if len(args) == 2 and not kwargs:  # from update(keys, values)
            SlimCacheLayer.lazy_initialization(self, *args)
        else:  # from update_conv_state / update_recurrent_state
            LinearAttentionLayer.lazy_initialization(self, **kwargs)

    def update(self, key_states, value_states, *args, **kwargs):
        return SlimCacheLayer.update(self, key_states, value_states, *args, **kwargs)

    def reset(self) -> None:
        LinearAttentionLayer.reset(self)
        SlimCacheLayer.reset(self)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        LinearAttentionLayer.reorder_cache(self, beam_idx)
        SlimCacheLayer.reorder_cache(self, beam_idx)

    def crop(self, tokens_to_remove: int) -> None:
        LinearAttentionLayer.crop(self, tokens_to_remove)
        SlimCacheLayer.crop(self, tokens_to_remove)

    def batch_repeat_interleave(self, repeats: int) -> None:
        LinearAttentionLayer.batch_repeat_interleave(self, repeats)
        SlimCacheLayer.batch_repeat_interleave(self, repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        LinearAttentionLayer.batch_select_indices(self, indices)
        SlimCacheLayer.batch_select_indices(self, indices)

    def offload(self):
        LinearAttentionLayer.offload(self)

    def prefetch(self):
        LinearAttentionLayer.prefetch(self)

    # The attention half answers for lengths and masks (LinearAttentionLayer comes first in the MRO).
    get_seq_length = SlimCacheLayer.get_seq_length
    get_mask_sizes = SlimCacheLayer.get_mask_sizes
    get_max_length = SlimCacheLayer.get_max_length
    is_compileable = False

    @property
    def is_croppable(self) -> bool:
        return LinearAttentionLayer.is_croppable.fget(self) and SlimCacheLayer.is_croppable.fget(self)


class SlimCache(Cache):
    """A bounded, compressed KV cache: StreamingLLM eviction x any storage format, per layer.

    Args:
        kv_quantize: storage of K and V: ``none`` (the model's dtype), ``fp16``, ``bf16``, ``fp8``,
            ``int8``/``int4``/``int3``/``int2`` (KIVI: K per channel in groups of ``group_size`` tokens, V per
            token), ``q8_0``/``q4_0``/``q4_1``/``q5_0``/``q5_1`` (llama.cpp blocks of 32 channels); or a named
            K/V preset (``k8v4``, ``k4v3``, ``k4v2``, ``k3v2``: ``k4v2`` is K int4, V int2).
        k_quantize, v_quantize: per-tensor overrides.
        sink, window: StreamingLLM; after every update each layer holds at most ``sink + window``
            tokens: the first ``sink`` seen and the last ``window``. ``window=None``: unbounded; the first
            ``sink`` tokens are then still kept apart at full precision (RotateKV's attention-sink-aware
            quantization: nothing is evicted, the sinks are never quantized).
        group_size, residual: KIVI. The newest ``residual`` tokens stay at full precision; older ones
            leave it ``group_size`` at a time and are encoded together, once (per-channel K shares
            scales across the group). Between ``residual`` and ``residual + group_size - 1`` tokens
            are at full precision; ``residual=0, group_size=1`` encodes every token on arrival. ``auto``
            (default): 128 without a window, with one at most a quarter of it in whole groups
            (:attr:`CacheConfig.residual_tokens`; ``report()["residual"]`` says what was chosen).
        v_group_size: channel group of per-token affine V (None: the whole head_dim).
        mean_center: K mean-centering bias: a GGUF file path, a ``BiasSet``, or a list of per-layer
            ``(H_kv, head_dim)`` tensors, in the basis K is stored in (``rotate``, ``pre_rope``; a file
            records it and a mismatch is an error). Subtracted from a key when it is encoded, where
            that lowers the key's error (per token), and added back on read.
        rotate: ``none``, ``k``, ``v`` or ``kv``: the encoded K / V are stored rotated by an orthonormal
            Hadamard matrix (:mod:`kvslim.cache.hadamard`); attention rotates the query once and the output
            back once. Needs ``config``. ``auto`` (default): every quantized tensor that can be rotated,
            K as a bias file records it. ``cache.rotate`` and ``report()`` say what was chosen.
        pre_rope: the K stream holds keys before RoPE, un-rotated with the model's own RoPE and rotated
            again on read (KVQuant); needs ``config`` and a RoPE of type default, linear, dynamic,
            llama3 or yarn. ``auto`` (default): on for 2-bit K where the model's RoPE allows it, and as
            a bias file records it. ``cache.pre_rope`` says what was chosen. (docs/quality.md,
            "Low-bit levers", for the measurements behind both defaults.)
        positions: where StreamingLLM's kept keys sit: ``cache`` (the paper's in-cache positions: sinks
            right before the window, the distance from a query to a sink bounded by ``sink + window``)
            or ``original`` (every key at its original position); ``auto`` (default) is ``cache`` where
            the model's RoPE can be moved, else ``original`` — ``cache.positions`` and ``report()`` say
            which. Only the fp sinks are re-rotated. See docs/streaming.md.
        keep_layers, keep_format: per-layer precision. The model layers ``keep_layers`` names (indices, negative
            from the end: ``(0, -1)`` or ``"first,last"``; default none) store K and V in ``keep_format`` (a format
            or preset; default ``none``, lossless) instead. Needs ``config``; an index out of range is a
            ValueError. ``cache.kept_layers`` holds the resolved indices; ``nbytes()`` counts each layer as stored.
        residual_dtype: storage of a lossy format's full-precision tokens (residual and sinks):
            ``auto`` (default: ``float16`` when the model's K/V are float32, else the model's dtype),
            ``model``, ``float16`` or ``bfloat16``. A value beyond float16's range is an error naming
            ``residual_dtype="model"``, never an inf.
        config: the model's config (recommended): checks the architecture, head_dim against the
            formats, and the bias file against the model's shapes up front.
        compressed_attention: whether decode steps hand the ``kvslim`` attention the stored segments;
            None decides it here, once, from ``config`` (True when the model uses ``"kvslim"``).
        observe: ``observe(layer_idx, keys, values)`` is called with every update's new (raw) keys and
            values before they are stored (:mod:`kvslim.calibration.calibrate` collects K means with it).
        observe_stored: hand ``observe`` the keys in the basis the K body stores them (rotated,
            pre-RoPE; never centered) instead of the raw keys.
        model_fingerprint: :func:`kvslim.calibration.fingerprint.model_fingerprint` of the model; a bias file recorded for
            another model is then refused unless ``allow_other_model=True`` (which warns).
        offloading: DynamicCache's option; only False is accepted (the compressed store is not offloaded).

    As DynamicCache: ``len(cache)`` layers, ``for keys, values, _ in cache`` (each layer's stored K/V decoded,
    see :attr:`SlimCacheLayer.keys`), ``cache.layers[i].keys``. Not supported: ``torch.export`` (no pytree
    is registered for SlimCache; its storage is not a fixed set of tensors).

    Sinks are stored at full precision (a handful of tokens; they anchor softmax).

    kvslim's own decode loop (:mod:`kvslim.generate`) keeps the position ids it feeds bounded on endless
    streams (``rebase_period``); under ``model.generate()`` the ids are absolute and the cache follows.
    """

    def __init__(
        self,
        *,
        kv_quantize: str = "none",
        k_quantize: str | None = None,
        v_quantize: str | None = None,
        sink: int = 0,
        window: int | None = None,
        group_size: int = DEFAULT_GROUP_SIZE,
        residual: int | str = "auto",
        v_group_size: int | None = None,
        mean_center=None,
        positions: str = DEFAULT_POSITIONS,
        residual_dtype: str = DEFAULT_RESIDUAL_DTYPE,
        rotate: str = DEFAULT_ROTATE,
        pre_rope: bool | str = DEFAULT_PRE_ROPE,
        keep_layers: tuple[int, ...] = (),
        keep_format: str = DEFAULT_KEEP_FORMAT,
        config=None,
        compressed_attention: bool | None = None,
        observe=None,
        observe_stored: bool = False,
        model_fingerprint: str | None = None,
        allow_other_model: bool = False,
        offloading: bool = False,
    ):
        if offloading is not False:
            raise ValueError(f"offloading={offloading!r}: {_NO_OFFLOADING}")
        path = os.fspath(mean_center) if isinstance(mean_center, (str, os.PathLike)) else None
        self.cache_config = CacheConfig(
            kv_quantize=kv_quantize,
            k_quantize=k_quantize,
            v_quantize=v_quantize,
            sink=sink,
            window=window,
            group_size=group_size,
            residual=residual,
            v_group_size=v_group_size,
            mean_center=path,
            positions=positions,
            residual_dtype=residual_dtype,
            rotate=rotate,
            pre_rope=pre_rope,
            keep_layers=keep_layers,
            keep_format=keep_format,
        )
        cfg = self.cache_config
        if mean_center is not None and path is None:
            # Tensors given directly: constructing the config with a placeholder path runs the same
            # format gate a file path gets (raises if K's format does not allow centering).
            cfg.replace(mean_center="<tensors>")
        if compressed_attention is not None and not isinstance(compressed_attention, bool):
            raise ValueError(
                f"compressed_attention must be True, False or None, got {compressed_attention!r}"
            )
        if observe is not None and not callable(observe):
            raise ValueError(f"observe must be a callable (layer_idx, keys, values) or None, got {observe!r}")
        if not isinstance(observe_stored, bool):
            raise ValueError(f"observe_stored must be True or False, got {observe_stored!r}")
        attention.register()
        #: Whether decode steps hand attention a Segments view (decided here, once; see attention.py).
        mla = config is not None and is_mla(text_config(config))
        if compressed_attention and mla:
            raise ValueError(
                "compressed_attention=True cannot serve MLA models: they expand the cached latent before attention"
            )
        self.compressed_attention = (
            (attention.uses_kvslim_attention(config) and not mla)
            if compressed_attention is None
            else compressed_attention
        )
        # A lossy cache read through a materializing attention warns once (see _warn_materializing), unless the
        # path was chosen explicitly or the model already uses "kvslim" (MLA: no compressed path to switch to).
        self._may_warn_materializing = compressed_attention is None and not attention.uses_kvslim_attention(
            config
        )
        self.observe = observe
        #: observe() sees the new keys in the basis the K body is stored in (rotated, pre-RoPE; never
        #: centered): what a bias for this cache's basis is the mean of (kvslim.calibration.calibrate)
        self.observe_stored = observe_stored
        self._base_memo = None  # (key, base, weakref to the position ids) of the forward served (_forward_base)
        self.pads: torch.Tensor | None = None  # (B,) left padding, when handed explicitly
        self.padding_explicit = False
        self.policy = KeepPolicy(sink=cfg.sink, window=cfg.window)
        self._codecs = {
            "k": make_codec(cfg.k_format, "k", group_size=cfg.group_size, v_group_size=cfg.v_group_size),
            "v": make_codec(cfg.v_format, "v", group_size=cfg.group_size, v_group_size=cfg.v_group_size),
        }
        self._biases: list[torch.Tensor] | None = None
        self._shapes = None
        #: the codecs of the layers keep_layers names (None: no layer is kept apart)
        self._keep_codecs: dict | None = None
        #: the model layers stored at keep_format (indices 0 .. n_layers - 1)
        self.kept_layers: frozenset[int] = frozenset()
        if cfg.keep_layers:
            if config is None:
                raise ValueError(
                    f"keep_layers={cfg.keep_layers} needs config=model.config (the model's number of layers)"
                )
            self._keep_codecs = {
                role: make_codec(fmt, role, group_size=cfg.group_size, v_group_size=cfg.v_group_size)
                for role, fmt in zip("kv", cfg.keep_formats, strict=True)
            }
        if config is not None:
            self._shapes = _model_shapes(config)
            self.kept_layers = cfg.kept_layers(self._shapes.n_layers)  # one line for an index out of range
            checks = [(f"{role}_quantize", role, codec) for role, codec in self._codecs.items()]
            checks += [("keep_format", role, codec) for role, codec in (self._keep_codecs or {}).items()]
            for what, role, codec in checks:
                try:
                    codec.check_head_dim(self._shapes.k_head_dim if role == "k" else self._shapes.v_head_dim)
                except ValueError as e:
                    raise ValueError(f"{what}={codec.name!r} cannot store this model's KV: {e}") from None
        # The low-bit levers in effect, "auto" resolved (docs/quality.md, "Low-bit levers"):
        self._hadamard, self._rope_source = resolve_levers(
            cfg, config, self._shapes, self._codecs, mean_center
        )
        plain_roles = [r for r in "kv" if self._hadamard[r] is not None and not self._codecs[r].lossy]
        if plain_roles and not observe_stored:  # (observe_stored: calibration observes keys in that basis)
            rest = "".join(r for r in cfg.rotate if r in "kv" and r not in plain_roles) or "none"
            names = " and ".join(f"{r}_quantize='none'" for r in plain_roles)
            raise ValueError(
                f"rotate={cfg.rotate!r} with {names}: only encoded (quantized) tensors are stored rotated, so "
                f"nothing would be; use rotate={rest!r} or quantize {' and '.join(r.upper() for r in plain_roles)}"
            )
        #: which encoded tensors are stored Hadamard-rotated: "none", "k", "v" or "kv"
        self.rotate = {(False, False): "none", (True, False): "k", (False, True): "v", (True, True): "kv"}[
            (self._hadamard["k"] is not None, self._hadamard["v"] is not None)
        ]
        #: whether the K stream holds keys before RoPE
        self.pre_rope = self._rope_source is not None
        if mean_center is not None:
            if self._shapes is None:
                raise ValueError(
                    "mean_center needs config=model.config to check the bias against the model's shapes"
                )
            from ..calibration.meancenter import load_mean_center

            self._biases = load_mean_center(
                mean_center,
                n_layers=self._shapes.n_layers,
                n_kv_heads=self._shapes.n_kv_heads,
                head_dim=self._shapes.head_dim,
                model_fingerprint=model_fingerprint,
                allow_other_model=allow_other_model,
                model_type=self._shapes.model_type,
                k_format=cfg.k_format,
                k_rot=self._hadamard["k"] is not None,
                pre_rope=self.pre_rope,
            )
        self.rotary, why = (None, "no config=model.config") if config is None else model_rotary(config)
        #: the position semantics in effect ("auto" resolved: "cache" wherever keys can be moved)
        self.positions = (
            cfg.positions if cfg.positions != "auto" else ("cache" if self.rotary else "original")
        )
        if cfg.positions == "cache" and cfg.window is not None and self.rotary is None:
            raise ValueError(
                f"positions='cache' re-rotates the sink keys, which needs the model's RoPE: {why}; "
                f"use positions='original'"
            )
        #: kvslim's loop re-bases position ids every this many tokens (None: never), see generate.py.
        # (None before transformers 5.24: the cache could not read the base back from the ids, see compat)
        self.rebase_period = rebase_period(self.policy, self.rotary) if compat.POSITIONS_REACH_CACHE else None
        if self._shapes is not None:
            super().__init__(
                layers=[self._new_layer(i, t, kw) for i, (t, kw) in enumerate(_layer_plan(config))]
            )
        else:
            super().__init__(layer_class_to_replicate=self._replicate)

    @classmethod
    def from_config(cls, cache_config: CacheConfig, *, config=None, **overrides) -> SlimCache:
        """Build from a :class:`~kvslim.config.CacheConfig` (e.g. ``parse_spec("int4,sink=4,window=1020")``)."""
        kwargs = cache_config.to_dict()
        kwargs.update(overrides)
        return cls(config=config, **kwargs)

    # -- construction helpers ------------------------------------------------------------------
    def _new_layer(self, i: int, layer_type: str, kwargs: dict):
        """The cache layer for model layer ``i`` of transformers' ``layer_type`` (module docstring)."""
        if layer_type in LINEAR_TYPES:
            return LinearAttentionLayer(
                **kwargs
            )  # recurrent / conv state, kept exactly as transformers keeps it
        if layer_type == "dummy":
            return DummyLayer()  # reads another layer's K/V (KV sharing) or has no attention: holds nothing
        # The model's own window bounds sliding and chunked layers (transformers keeps the last window - 1
        # tokens); StreamingLLM's sinks + window apply to full-attention layers only.
        window = kwargs.get("sliding_window")
        policy = self.policy if window is None else KeepPolicy(sink=0, window=max(1, int(window) - 1))
        factory = functools.partial(self._new_store, i, policy)
        if layer_type in HYBRID_TYPES:
            return SlimHybridLayer(factory, self, i, layer_type, kwargs.get("number_of_states", 1))
        return SlimCacheLayer(factory, self, i, layer_type)

    def _layer_storage(self, layer_idx: int) -> tuple:
        """``(k codec, v codec, k Hadamard, v Hadamard, k bias, pre_rope)`` of model layer ``layer_idx``: the
        cache's, or for a layer ``keep_layers`` names its ``keep_format`` codecs, with the cache's Hadamard rotation
        and pre-RoPE K where they are quantized (not ``none`` or fp16/bf16: there a rotation only adds rounding,
        and a kept ``none`` layer stays exactly the plain cache's), and the K bias where its K format takes one
        in the same basis (None otherwise: nothing held that is not used)."""
        bias = None if self._biases is None else self._biases[layer_idx]
        if layer_idx not in self.kept_layers:
            codecs, had = self._codecs, self._hadamard
            return codecs["k"], codecs["v"], had["k"], had["v"], bias, self.pre_rope
        codecs = self._keep_codecs
        quantized = {role: codecs[role].lossy and codecs[role].family != "cast" for role in ("k", "v")}
        had = {role: self._hadamard[role] if quantized[role] else None for role in ("k", "v")}
        k = codecs["k"]
        if not (k.lossy and k.format.mean_center and had["k"] is self._hadamard["k"]):
            bias = None
        return k, codecs["v"], had["k"], had["v"], bias, self.pre_rope and quantized["k"]

    def _new_store(self, layer_idx: int, policy: KeepPolicy | None = None) -> SlimLayer:
        k_codec, v_codec, k_hadamard, v_hadamard, bias, pre_rope = self._layer_storage(layer_idx)
        cfg = self.cache_config
        return SlimLayer(
            self.policy if policy is None else policy,
            k_codec,
            v_codec,
            cfg.residual_tokens,
            cfg.group_size,
            k_bias=bias,
            positions=self.positions,
            rotary=self.rotary,
            fp_dtype=_FP_DTYPES[cfg.residual_dtype],
            k_hadamard=k_hadamard,
            v_hadamard=v_hadamard,
            pre_rope=pre_rope,
        )

    def _replicate(self) -> SlimCacheLayer:
        idx = len(self.layers)
        return SlimCacheLayer(functools.partial(self._new_store, idx), self, idx)

    def _forward_base(self, position_ids, pads, seen: int, n_new: int, batch: int) -> int:
        """:func:`~kvslim.cache.positions.base_from_positions`, once per forward: every layer of a forward hands the
        same position ids at the same count (a check and a host sync per layer otherwise)."""
        key = (id(position_ids), id(pads), seen, n_new, batch)
        memo = self._base_memo
        if memo is not None and memo[0] == key and memo[2]() is position_ids:
            return memo[1]
        base = base_from_positions(position_ids, pads, seen, n_new, batch)
        # a weak reference (the cache holds no tensor it does not count): a dead one never matches
        ref = (lambda: None) if position_ids is None else weakref.ref(position_ids)
        self._base_memo = (key, base, ref)
        return base

    # -- kvslim's own surface --------------------------------------------------------------------
    def set_left_padding(self, pads: torch.Tensor | None) -> None:
        """Hand over the batch's left padding, once, before the first token: ``pads`` (B,) int — row
        ``b``'s first ``pads[b]`` tokens are padding — or None for no padding. (kvslim's decode loop
        does this from the attention mask at prefill; see the module docstring for ``generate()``.)
        """
        if self.get_seq_length() != 0:
            raise ValueError(
                f"set_left_padding must be called before the first token; this cache has seen {self.get_seq_length()}"
            )
        if pads is not None:
            if not isinstance(pads, torch.Tensor) or pads.ndim != 1 or pads.dtype.is_floating_point:
                raise ValueError(
                    f"pads must be a 1-D integer tensor (one count per row) or None, got {pads!r}"
                )
            if bool((pads < 0).any()):
                raise ValueError(f"pads must be >= 0, got {pads.tolist()}")
            pads = pads.long()
        self.pads = pads
        self.padding_explicit = True

    def use_compressed_attention(self, enabled: bool = True) -> None:
        """Choose explicitly whether decode steps hand the ``kvslim`` attention the stored segments
        (True; the model must use ``attn_implementation="kvslim"``) or materialized K/V (False)."""
        if not isinstance(enabled, bool):
            raise ValueError(f"enabled must be True or False, got {enabled!r}")
        self.compressed_attention = enabled
        self._may_warn_materializing = False

    def stores(self) -> list[SlimLayer]:
        """The K/V store of every layer that holds one, in layer order (linear-attention and KV-sharing
        layers hold none)."""
        return [layer.store for layer in self.layers if isinstance(layer, SlimCacheLayer)]

    # -- accounting ------------------------------------------------------------------------------
    def nbytes(self) -> int:
        """Every byte the cache holds: codes, scales, zeros, residual, sinks, biases, bookkeeping (buffer
        slack included)."""
        return sum(self.components().values())

    def projected_nbytes(self, tokens: int, *, batch: int = 1, dtype: torch.dtype = torch.float32) -> int:
        """The most bytes this cache will hold while fed ``tokens`` tokens per row (a prompt, then one per
        step) for ``batch`` rows of a model computing in ``dtype``: an upper bound to reserve up front (the
        batch engine's memory budget). A bounded cache reaches it once full and never exceeds it. Needs
        ``config`` (the KV shapes); linear-attention states are not projected (ValueError)."""
        if self._shapes is None:
            raise ValueError("projected_nbytes needs a cache built with config=model.config (the KV shapes)")
        if any(isinstance(layer, LinearAttentionCacheLayerMixin) for layer in self.layers):
            raise ValueError("projected_nbytes cannot project linear-attention states (this model has some)")
        shapes = self._shapes
        kv = (batch, shapes.n_kv_heads, shapes.k_head_dim)
        held = sum(s.projected_nbytes(tokens, kv, shapes.v_head_dim, dtype) for s in self.stores())
        rotary = self._rotary_nbytes()
        if self._rope_source is not None:  # pre-RoPE's angle table over the positions read (Rotary.table)
            span = (
                tokens
                if self.rebase_period is None
                else min(tokens, self.rebase_period + self.policy.capacity)
            )
            half = self._rope_source.rotary.inv_freq.numel()
            rotary += (span + max(64, span // 4) + 1) * half * 4 * 2  # cos and sin, float32
        return held + rotary

    def live_nbytes(self) -> int:
        """Bytes of the stored tokens alone, without preallocated buffer slack."""
        return sum(s.live_nbytes() for s in self.stores())

    def stored_tokens(self) -> int:
        """Tokens held now by a full-attention layer (every one holds the same number: they see the same
        tokens and share the policy; sliding layers hold at most the model's window)."""
        kv = [layer for layer in self.layers if isinstance(layer, SlimCacheLayer)]
        full = [layer for layer in kv if not layer.is_sliding] or kv
        return full[0].store.stored if full else 0

    def components(self) -> dict[str, int]:
        """Bytes per kind of tensor, summed over layers (``rotary``: the RoPE frequencies, held once)."""
        out: dict[str, int] = {}
        for s in self.stores():
            for name, n in s.components().items():
                out[name] = out.get(name, 0) + n
        out["linear_state"] = sum(_linear_state_bytes(layer) for layer in self.layers)
        out["rotary"] = self._rotary_nbytes()
        return out

    def _rotary_nbytes(self) -> int:
        """The RoPE frequencies (+ pre-RoPE's angle table), each held once; the Hadamard block matrices are
        module-level, shared by every cache (kvslim.cache.hadamard: 4 * block^2 bytes per block size, 16 KiB for 64),
        not held here."""
        rotaries = {
            id(r): r for r in (self.rotary, getattr(self._rope_source, "rotary", None)) if r is not None
        }
        return sum(r.nbytes() for r in rotaries.values())

    def layer_type_bytes(self) -> dict[str, dict[str, int]]:
        """Per transformers layer type: how many layers, how many hold K/V, and their bytes (the depth axis:
        KV-sharing layers hold nothing, linear-attention layers only their recurrent state)."""
        out: dict[str, dict[str, int]] = {}
        for layer in self.layers:
            kind = getattr(layer, "layer_type", None) or _layer_kind(layer)
            row = out.setdefault(kind, {"layers": 0, "kv_layers": 0, "bytes": 0})
            row["layers"] += 1
            if isinstance(layer, SlimCacheLayer):
                row["kv_layers"] += 1
                row["bytes"] += layer.store.nbytes()
            row["bytes"] += _linear_state_bytes(layer)
        return out

    def fp16_full_cache_bytes(self, tokens: int | None = None) -> int:
        """Bytes an fp16 cache without eviction would need for ``tokens`` (default: tokens seen)."""
        tokens = self.get_seq_length() if tokens is None else tokens
        total = 0
        for s in self.stores():
            if s.kv_shape is not None:
                batch, heads, k_dim = s.kv_shape
                total += batch * heads * tokens * (k_dim + s.v_dim) * 2  # K and V, 2 bytes each
        return total

    def report(self) -> dict:
        """Tokens seen and stored, bytes held (total and per component), and the fp16 full-cache bytes."""
        seen = self.get_seq_length()
        fp16 = self.fp16_full_cache_bytes(seen)
        nbytes = self.nbytes()
        return {
            "tokens_seen": seen,
            "tokens_stored": self.stored_tokens(),
            "capacity": self.policy.capacity,
            "cache_bytes": nbytes,
            "live_bytes": self.live_nbytes(),
            "fp16_full_cache_bytes": fp16,
            "ratio_to_fp16_full": (nbytes / fp16) if fp16 else None,
            "components": self.components(),
            "layer_types": self.layer_type_bytes(),
            "kv_layers": len(self.stores()),
            "layers": len(self.layers),
            "config": self.cache_config.to_dict(),
            "positions": self.positions,
            "rotate": self.rotate,
            "pre_rope": self.pre_rope,
            "residual": self.cache_config.residual_tokens,
        }

    # -- prompt cache files (kvslim.promptcache) ----------------------------------------------------
    def save(
        self, path, *, token_ids: torch.Tensor | None = None, model_fingerprint: str | None = None
    ) -> dict:
        """Write this cache to ``path`` as it is stored (no re-quantization), atomically; ``token_ids`` (B, T)
        and ``model_fingerprint`` are recorded for the checks on load. Returns the file's header."""
        from ..promptcache import save

        return save(self, path, token_ids=token_ids, model_fingerprint=model_fingerprint)

    @classmethod
    def load(
        cls, path, *, config, model_fingerprint: str | None = None, mean_center=None, device=None
    ) -> SlimCache:
        """A cache saved with :meth:`save`, rebuilt for the model of ``config`` with the file's settings; a
        file for another model, format, levers or bias, or a damaged one, is a ValueError naming what differs
        (:func:`kvslim.promptcache.load`, which also returns the saved token ids)."""
        from ..promptcache import load

        return load(
            path, config=config, model_fingerprint=model_fingerprint, mean_center=mean_center, device=device
        ).cache

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """transformers' ``Cache.update``: append ``key_states`` / ``value_states`` ``(B, H_kv, T, D)`` to layer
        ``layer_idx`` and return what attention reads. ValueError for a layer index that is not one of the
        model's (a negative one is not counted from the end) and for a first update with no tokens."""
        if isinstance(layer_idx, bool) or not isinstance(layer_idx, int) or layer_idx < 0:
            raise ValueError(
                f"layer_idx must be an integer >= 0 (the model layer's index), got {layer_idx!r}"
            )
        if self.layer_class_to_replicate is None and layer_idx >= len(self.layers):
            raise ValueError(
                f"layer_idx {layer_idx} is out of range: this cache has {len(self.layers)} layers"
            )
        if isinstance(key_states, torch.Tensor) and key_states.dim() == 4 and key_states.shape[2] == 0:
            layer = self.layers[layer_idx] if layer_idx < len(self.layers) else None
            if layer is None or not getattr(layer, "is_initialized", False):
                raise ValueError(
                    f"the first update of layer {layer_idx} has no tokens (key_states {tuple(key_states.shape)}); "
                    f"expected (B, H_kv, T, D) with T >= 1"
                )
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def __iter__(self):
        """As DynamicCache's: ``(keys, values, None)`` per layer, the stored K/V decoded (None before any
        update; layers without K/V, linear-attention or KV-sharing ones, give None too)."""
        for layer in self.layers:
            yield getattr(layer, "keys", None), getattr(layer, "values", None), None

    def __repr__(self) -> str:
        return f"SlimCache({self.cache_config.to_spec()!r}, layers={len(self.layers)})"


_materializing_warned = False  # once per process


def _warn_materializing(cache: SlimCache) -> None:
    """Warn, once per process, that a lossy cache is being read through an attention that decodes every stored
    token at every step (sdpa, eager, ...): correct, but several times slower than the ``kvslim`` attention."""
    global _materializing_warned
    if not any(codec.lossy for codec in cache._codecs.values()):
        cache._may_warn_materializing = False  # lossless: nothing to decode, never ask again
        return
    _materializing_warned = True
    warnings.warn(
        f"SlimCache({cache.cache_config.to_spec()!r}) is read through an attention implementation that decodes "
        f"every stored token at every decode step (slow on long contexts). Call kvslim.enable(model) before "
        f"building the cache (or cache.use_compressed_attention(True) on a model already using "
        f"attn_implementation='kvslim') to attend on the compressed codes directly.",
        stacklevel=4,
    )


def _model_shapes(config) -> ModelShapes:
    """The model's attention geometry (raises ValueError for a config that is not a decoder LM's)."""
    return ModelShapes.from_config(config)


#: transformers' layer types and what SlimCache keeps for each (DYNAMIC_LAYER_TYPE_MAPPING is the reference)
SLIDING_TYPES = ("sliding_attention", "chunked_attention", "hybrid_sliding")
LINEAR_TYPES = ("linear_attention", "conv")
HYBRID_TYPES = ("hybrid", "hybrid_sliding")
SUPPORTED_TYPES = (
    "full_attention",
    "sliding_attention",
    "chunked_attention",
    "dummy",
    *LINEAR_TYPES,
    *HYBRID_TYPES,
)


def _layer_plan(config) -> list[tuple[str, dict]]:
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


def _linear_state_bytes(layer) -> int:
    """Bytes of a linear-attention layer's conv and recurrent states (0 for other layers)."""
    if not isinstance(layer, LinearAttentionCacheLayerMixin):
        return 0
    tensors = [*layer.conv_states.values(), *layer.recurrent_states.values()]
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _layer_kind(layer) -> str:
    if isinstance(layer, DummyLayer):
        return "dummy"
    if isinstance(layer, LinearAttentionCacheLayerMixin):
        return "linear_attention"
    return type(layer).__name__


#: residual_dtype -> what a Stream is told (None: the model's dtype; "auto": decided per tensor dtype)
_FP_DTYPES = {"auto": "auto", "model": None, "float16": torch.float16, "bfloat16": torch.bfloat16}

