"""The static (compile-friendly) SlimCache: :mod:`kvslim.cache.static`'s fixed buffers behind transformers' layer
contract, so ``torch.compile`` can trace a decode step (:mod:`kvslim.compiled`, docs/compile.md).

One of the cache adapters that import transformers' Cache API (the others: :mod:`kvslim.cache.adapter`,
:mod:`kvslim.cache.layer_adapter`, :mod:`kvslim.cache.ragged`); it subclasses :class:`~kvslim.cache.adapter.SlimCache`
for everything decided at construction (formats, levers, bias, validation) and swaps every layer's store for a
:class:`~kvslim.cache.static.StaticStore`. It knows nothing about how a static store lays out its slots, nor
about torch.compile itself (:mod:`kvslim.compiled`).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import CacheLayerMixin

from .. import attention, compat
from ..checks import check_int
from ..shapes import is_mla, text_config
from .adapter import SlimCache
from .basis import BodyBasis
from .build import _FP_DTYPES, layer_plan
from .layer_adapter import _refuse_assignment
from .static import StaticStore


class StaticSlimCacheLayer(CacheLayerMixin):
    """One layer of a :class:`StaticSlimCache`: a :class:`~kvslim.cache.static.StaticStore` behind transformers'
    layer contract. A one-token update (the decode step) is branch-free and returns the store's
    :class:`~kvslim.cache.static.StaticSegments` for the ``kvslim`` attention; a longer one (prefill) stores the
    tokens on the host's decisions and returns the stored tokens decoded, followed by the new ones at full
    precision (what :class:`SlimCacheLayer` hands attention for a prefill chunk)."""

    is_compileable = True
    is_sliding = False

    def __init__(self, store, layer_idx: int):
        super().__init__()
        self.store = store
        self.layer_idx = layer_idx
        self.layer_type = "full_attention"

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.store.allocate(key_states, value_states)
        self.device, self.dtype = key_states.device, key_states.dtype
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if key_states.shape[2] == 1:
            view = self.store.write_one(key_states, value_states)
            return view, view
        return self.store.write(key_states, value_states)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        query_length = compat.mask_query_length(query_length)
        if query_length == 1:  # the decode step: attention reads every slot and masks them itself
            return self.store.slots, 0
        stored = self.store.stored
        return stored + query_length, int(self.store.seen) - stored

    def get_seq_length(self):
        if torch.compiler.is_compiling():
            return self.store.seen  # a tensor inside a compiled region (no host read)
        return int(self.store.seen)

    def get_max_length(self) -> int:
        return -1 if self.store.window is None and self.store.capacity is None else self.store.slots

    get_max_cache_shape = get_max_length

    @property
    def keys(self) -> torch.Tensor | None:
        """Every stored key, oldest first, decoded: (B, H_kv, stored, D); None before the first update."""
        kv = self.store.materialize()
        return None if kv is None else kv[0]

    @keys.setter
    def keys(self, value) -> None:
        if value is not None:
            _refuse_assignment("keys", value)

    @property
    def values(self) -> torch.Tensor | None:
        """Every stored value, as :attr:`keys`."""
        kv = self.store.materialize()
        return None if kv is None else kv[1]

    @values.setter
    def values(self, value) -> None:
        if value is not None:
            _refuse_assignment("values", value)

    def reset(self) -> None:
        raise ValueError("a static SlimCache cannot be reset in place; build a new one")

    def crop(self, tokens_to_remove: int) -> None:
        raise ValueError(
            "a static SlimCache cannot be cropped (its tokens leave the fp ring in encoded groups)"
        )


class StaticSlimCache(SlimCache):
    """A :class:`SlimCache` in fixed-capacity buffers: every decode step is the same graph, so
    ``torch.compile`` traces it once (``is_compileable=True``; docs/compile.md). Same options as SlimCache,
    plus ``max_cache_len`` (the most tokens held, needed without a window; ignored with one: the window
    bounds it). The tokens kept, the groups encoded and the values attention reads are those of a SlimCache
    with the same options.

    What it does not serve (a clear error at construction, never a silently different cache): a model not
    using the ``kvslim`` attention, layers other than full attention (sliding, linear, KV-sharing), MLA,
    ``pre_rope`` (``auto`` resolves to False here), K and V of which only one is quantized, left padding,
    ``observe``. Positions are as in a SlimCache (``auto``: StreamingLLM's in-cache positions where the model's
    RoPE allows it: the sinks are moved right before the window in the step's graph), but the ids are never
    re-based (``rebase_period`` None): a query sits at its true position however long the stream.
    """

    def __init__(self, *, max_cache_len: int | None = None, config=None, **kwargs):
        if config is None:
            raise ValueError("a static SlimCache needs config=model.config (the model's layers and shapes)")
        if max_cache_len is not None:
            check_int("max_cache_len", max_cache_len, minimum=1, expected="a positive integer or None")
        if kwargs.pop("compressed_attention", None) not in (None, True):
            raise ValueError(
                "a static SlimCache always hands the kvslim attention its slots (compressed_attention)"
            )
        if kwargs.get("observe") is not None:
            raise ValueError("a static SlimCache does not observe updates (calibrate with a SlimCache)")
        # "auto" pre-RoPE is this cache's to decide: the K stream stays as fed (an explicit True is refused below)
        if kwargs.setdefault("pre_rope", "auto") == "auto":
            kwargs["pre_rope"] = False
        super().__init__(config=config, compressed_attention=None, **kwargs)
        cfg = self.cache_config
        problems = []
        if not attention.uses_kvslim_attention(config):
            problems.append("the model must use attn_implementation='kvslim' (kvslim.enable(model))")
        if is_mla(text_config(config)):
            problems.append("MLA models expand the cached latent before attention")
        types = sorted({t for t, _ in layer_plan(config) if t != "full_attention"})
        if types:
            problems.append(f"every layer must be full attention, this model has {', '.join(types)} layers")
        if self.pre_rope:
            problems.append("pre_rope keys are rotated on read per position (pass pre_rope=False)")
        if cfg.window is None and max_cache_len is None:
            problems.append("without a window it needs max_cache_len (the most tokens it will hold)")
        if problems:
            raise ValueError("cannot build a static SlimCache: " + "; ".join(problems))
        self._max_len = max_cache_len if cfg.window is None else None
        sinks = cfg.sink_tokens
        if cfg.sink == "auto" and self._max_len is not None:
            # the default's 16 sinks in a cache of at most 16 tokens: every token but the last is a sink (a SlimCache
            # of the same tokens keeps them all in its sinks: full precision either way), never a refusal
            sinks = min(sinks, self._max_len - 1)
        layers = []
        for i in range(len(self.layers)):
            # each layer's own formats and levers (keep_layers)
            k_codec, v_codec, k_hadamard, v_hadamard, bias, _ = self._layer_storage(i)
            store = StaticStore(
                k_codec,
                v_codec,
                sink=sinks,
                window=cfg.window,
                residual=cfg.residual_tokens,
                group_size=cfg.group_size,
                capacity=self._max_len,
                k_basis=BodyBasis(k_hadamard, bias) if k_codec.lossy else None,
                v_basis=BodyBasis(v_hadamard) if v_codec.lossy else None,
                fp_dtype=_FP_DTYPES[cfg.residual_dtype],
                positions=self.positions,
                rotary=self.rotary,
            )
            layers.append(StaticSlimCacheLayer(store, i))
        self.layers = layers
        self.rebase_period = None  # positions are absolute: nothing is ever re-based

    @property
    def is_compileable(self) -> bool:
        return True

    @property
    def max_cache_len(self) -> int | None:
        """The most tokens held without a window (None with one: the window bounds it)."""
        return self._max_len

    def set_left_padding(self, pads: torch.Tensor | None) -> None:
        if pads is not None and bool((pads != 0).any()):
            raise ValueError("a static SlimCache serves rows of equal length (no left padding)")
        self.padding_explicit = False

    def stores(self):
        return [layer.store for layer in self.layers]

    def stored_tokens(self) -> int:
        return self.layers[0].store.stored if self.layers else 0

    def layer_type_bytes(self) -> dict[str, dict[str, int]]:
        return {
            "full_attention": {
                "layers": len(self.layers),
                "kv_layers": len(self.layers),
                "bytes": self.nbytes(),
            }
        }

    def projected_nbytes(self, tokens: int, *, batch: int = 1, dtype: torch.dtype = torch.float32) -> int:
        raise ValueError(
            "a static SlimCache holds its capacity from the first write on: read nbytes() after it"
        )

    def use_compressed_attention(self, enabled: bool = True) -> None:
        if not enabled:
            raise ValueError("a static SlimCache always hands the kvslim attention its slots")

    def save(self, *args, **kwargs):
        raise ValueError("a static SlimCache cannot be saved yet; save a SlimCache of the same options")

    def __repr__(self) -> str:
        return f"StaticSlimCache({self.cache_config.to_spec()!r}, layers={len(self.layers)})"
