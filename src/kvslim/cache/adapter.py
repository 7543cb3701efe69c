"""SlimCache: the transformers adapter (``Cache``), the cache-wide half of the glue to transformers.

Usage::

    from kvslim import SlimCache
    cache = SlimCache(kv_quantize="int4", sink=4, window=1020, config=model.config)
    out = model.generate(**inputs, past_key_values=cache)      # or model(..., cache=cache)

Everything about storage lives in :mod:`kvslim.cache.layer`, everything about which tokens are kept in
:mod:`kvslim.cache.policy`, every format in :mod:`kvslim.formats`. Transformers' per-layer contract
(``update``, ``get_seq_length``, ``get_mask_sizes``, ``reorder_cache``, ``crop``, ...) is mapped onto them
by :mod:`kvslim.cache.layer_adapter`; the options are resolved by :mod:`kvslim.cache.build`, the bytes
counted by :mod:`kvslim.cache.accounting`. This module holds what is decided once per cache or per forward
(padding, the position base, the attention path) and the cache-wide ``Cache`` surface. The modules that
import transformers' Cache API are this one, :mod:`~kvslim.cache.layer_adapter`,
:mod:`~kvslim.cache.static_adapter` and :mod:`~kvslim.cache.ragged` (and :mod:`kvslim.compat`, which
names its classes per release); no other module of kvslim does (tests/test_layout.py checks it). This module
knows nothing about how tokens are stored, kept or positioned, nor any format; it reaches the prompt-cache
files (:mod:`kvslim.promptcache`) only in :meth:`SlimCache.save` / :meth:`SlimCache.load`.

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
import weakref

import torch
from transformers.cache_utils import Cache

from .. import attention
from ..config import (
    DEFAULT_CLIP,
    DEFAULT_CODEBOOK,
    DEFAULT_GROUP_SIZE,
    DEFAULT_KEEP_FORMAT,
    DEFAULT_POSITIONS,
    DEFAULT_PRE_ROPE,
    DEFAULT_RESIDUAL_DTYPE,
    DEFAULT_ROTATE,
    DEFAULT_VARNORM,
    CacheConfig,
)
from ..shapes import is_mla, text_config
from .accounting import CacheAccounting
from .build import layer_plan, layer_storage, new_layer, new_store, resolve_storage
from .layer import SlimLayer
from .layer_adapter import _NO_OFFLOADING, SlimCacheLayer
from .policy import KeepPolicy
from .positions import base_from_positions


class SlimCache(CacheAccounting, Cache):
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
            quantization: nothing is evicted, the sinks are never quantized). ``sink="auto"`` (default): the
            first 16 tokens where the cache quantizes and has no window, else none
            (:attr:`~kvslim.config.CacheConfig.sink_tokens`).
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
        varnorm: variance normalization of the affine formats' encoded groups (:mod:`kvslim.formats.varnorm`):
            ``on``, ``off`` or ``auto`` (default: per format, as measured in docs/quality.md). ``report()["varnorm"]``
            says which streams it normalizes.
        clip: range clipping of the affine formats' slices (:mod:`kvslim.formats.clip`): ``v``, ``k``, ``kv``,
            ``off`` or ``auto`` (default: where docs/quality.md measured it helps); ``report()["clip"]`` says which.
        codebook: Lloyd-Max codebooks of the 2- and 3-bit affine formats (:mod:`kvslim.formats.codebook`): ``v``,
            ``k``, ``kv``, ``off`` or ``auto`` (default: where docs/quality.md measured it helps);
            ``report()["codebook"]`` says which streams use one (decoded by the torch reference kernels).
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

    _keep_decoded = False  # keep_decoded(): stores keep their bodies decoded between a long prompt's chunks

    def __init__(
        self,
        *,
        kv_quantize: str = "none",
        k_quantize: str | None = None,
        v_quantize: str | None = None,
        sink: int | str = "auto",
        window: int | None = None,
        group_size: int = DEFAULT_GROUP_SIZE,
        residual: int | str = "auto",
        v_group_size: int | None = None,
        mean_center=None,
        positions: str = DEFAULT_POSITIONS,
        residual_dtype: str = DEFAULT_RESIDUAL_DTYPE,
        rotate: str = DEFAULT_ROTATE,
        pre_rope: bool | str = DEFAULT_PRE_ROPE,
        varnorm: str = DEFAULT_VARNORM,
        clip: str = DEFAULT_CLIP,
        codebook: str = DEFAULT_CODEBOOK,
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
        if path is None and mean_center is not None and rotate == "fitted":
            path = "<tensors>"  # a BiasSet holding the rotation (the engine's file read once, a rank's shard)
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
            varnorm=varnorm,
            clip=clip,
            codebook=codebook,
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
        # A lossy cache read through a materializing attention warns once (kvslim.cache.layer_adapter._warn_materializing), unless the
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
        #: every storage decision, "auto" resolved (kvslim.cache.build); the fields below are read from it
        s = self._storage = resolve_storage(
            cfg,
            config=config,
            mean_center=mean_center,
            observe_stored=observe_stored,
            model_fingerprint=model_fingerprint,
            allow_other_model=allow_other_model,
        )
        self.policy = s.policy
        #: the model layers stored at keep_format (indices 0 .. n_layers - 1)
        self.kept_layers: frozenset[int] = s.kept_layers
        #: which encoded tensors are stored Hadamard-rotated: "none", "k", "v" or "kv"
        self.rotate = s.rotate
        #: whether the K stream holds keys before RoPE
        self.pre_rope = s.pre_rope
        #: the model's RoPE where keys can be moved (None otherwise)
        self.rotary = s.rotary
        #: the position semantics in effect ("auto" resolved: "cache" wherever keys can be moved)
        self.positions = s.positions
        #: kvslim's loop re-bases position ids every this many tokens (None: never), see generate.py.
        self.rebase_period = s.rebase_period
        self._codecs, self._keep_codecs, self._hadamard = s.codecs, s.keep_codecs, s.hadamard
        self._rope_source, self._shapes, self._biases = s.rope_source, s.shapes, s.biases
        if self._shapes is not None:
            super().__init__(
                layers=[new_layer(self, i, t, kw) for i, (t, kw) in enumerate(layer_plan(config))]
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
    def _layer_storage(self, layer_idx: int) -> tuple:
        """:func:`kvslim.cache.build.layer_storage` of model layer ``layer_idx``."""
        return layer_storage(self._storage, layer_idx)

    def _new_store(self, layer_idx: int, policy: KeepPolicy | None = None) -> SlimLayer:
        store = new_store(self._storage, self.cache_config, layer_idx, self.policy if policy is None else policy)
        if self._keep_decoded:  # a layer made after keep_decoded(True) (lazily, or by a reset) keeps too
            store.k.keep_decoded(True)
            store.v.keep_decoded(True)
        return store

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

    def keep_decoded(self, on: bool = True) -> None:
        """Keep each layer's encoded body decoded between the reads of a long prompt's chunks (on) or free the copies
        (off): a chunk longer than ``FAST_MAX_QUERY`` reads every stored token materialized, and kept, it decodes only
        the tokens encoded since the last chunk, with the same bits (:meth:`kvslim.cache.stream.Stream.keep_decoded`).
        Costs a copy of the streams while on (float32 where a body has a basis, else the model's dtype;
        :meth:`kept_nbytes`, :meth:`projected_kept_nbytes`); an eviction starts a layer's copy over, so a window
        shorter than the prompt gains nothing. Layers made later (lazily, or by a reset) follow the setting. The batch
        engine turns it on for a prompt of more than one chunk and off after its last; :attr:`SlimCacheLayer.keys`
        stays a new tensor on each read."""
        if not isinstance(on, bool):
            raise ValueError(f"on must be True or False, got {on!r}")
        self._keep_decoded = on
        for s in self.stores():
            s.k.keep_decoded(on)
            s.v.keep_decoded(on)

    def stores(self) -> list[SlimLayer]:
        """The K/V store of every layer that holds one, in layer order (linear-attention and KV-sharing
        layers hold none)."""
        return [layer.store for layer in self.layers if isinstance(layer, SlimCacheLayer)]

    # accounting (nbytes, projected_nbytes, components, layer_type_bytes, report, ...): CacheAccounting

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
            path,
            config=config,
            new_cache=SlimCache.from_config,  # the builder, so that kvslim.promptcache need not import this module
            model_fingerprint=model_fingerprint,
            mean_center=mean_center,
            device=device,
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
