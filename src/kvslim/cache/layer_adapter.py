"""transformers' per-layer contract over kvslim's per-layer stores: :class:`SlimCacheLayer`, :class:`SlimHybridLayer`.

Each model layer of a :class:`~kvslim.SlimCache` is one of these (or one of transformers' own layers for
linear-attention and KV-sharing layers, see :mod:`kvslim.cache.build`). They map ``update``, ``get_seq_length``,
``get_mask_sizes``, ``reorder_cache``, ``crop``, ... onto a :class:`~kvslim.cache.layer.SlimLayer`, and ask the
owning cache for what is decided once per cache or per forward (padding, the position base, the attention path,
the observer). Masking after eviction: a layer holding ``stored`` of ``seen`` tokens reports
``get_mask_sizes(q) = (stored + q, seen - stored)`` (see :mod:`kvslim.cache.adapter`).

This module knows nothing about how the cache was configured (formats, levers, bias files) nor about the
attention implementation: whether a forward gets a :class:`~kvslim.cache.segments.Segments` view is the owner's
``compressed_attention`` and :data:`~kvslim.cache.segments.FAST_MAX_QUERY`.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import torch
from transformers.cache_utils import CacheLayerMixin

from .. import compat
from ..compat import LinearAttentionLayer  # by release: see compat
from .layer import SlimLayer
from .positions import max_position, pads_from_positions
from .segments import FAST_MAX_QUERY

if TYPE_CHECKING:
    from .adapter import SlimCache

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
        compressed = owner.compressed_attention and key_states.shape[2] <= FAST_MAX_QUERY
        out = store.append(key_states, value_states, segments=compressed, base=base, rope=rope)
        if store.rotary is not None and self is owner.layers[-1]:
            store.rotary.forget_rows()  # the forward's shared sink angles end with its last layer (Rotary.rows_angles)
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
