"""Memory: the bytes each mode holds at each length, from the codecs' real encodings.

Two ways to count, one definition of a stored byte (every stored tensor: codes, scales, zeros, the
full-precision residual and sinks, the mean-centering bias; not the buffers' preallocated slack):

- a formula, :func:`cache_bytes`, mirrors :class:`kvslim.cache.layer.SlimLayer`'s storage for a model's
  shapes, so a table up to 128k tokens costs no forward pass (a test checks it against a real
  SlimCache's tensors);
- a measurement, :func:`kv_bits`, reads a real cache an evaluation has just filled: bits per stored
  K/V element, the number every ``kvslim eval`` table prints next to its quality columns. Measured
  rather than projected, so whatever a config stores (a lever's extra scales, layers kept at a higher
  precision) is counted without this module knowing about it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from ..config import MEAN_CENTER_FORMATS, CacheConfig
from ..formats.varnorm import cache_codec
from ..shapes import ModelShapes
from .modes import check_int, resolve_modes


@dataclass(frozen=True)
class ModelShape:
    """What the cache size depends on: layers, KV heads, head_dim, and the cache's full-precision dtype."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float32

    @classmethod
    def from_config(cls, model_config, dtype: torch.dtype = torch.float32) -> ModelShape:
        """From a transformers config, read by :meth:`kvslim.shapes.ModelShapes.from_config`."""
        s = ModelShapes.from_config(model_config)
        return cls(s.n_layers, s.n_kv_heads, s.head_dim, dtype)

    @property
    def dtype_bytes(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    def full_cache_bytes(self, tokens: int, element_bytes: int, batch: int = 1) -> int:
        """An uncompressed cache of ``tokens`` tokens at ``element_bytes`` per element (2 for fp16)."""
        return 2 * self.layers * batch * self.kv_heads * self.head_dim * tokens * element_bytes


def _codec_costs(codec, shape: ModelShape) -> tuple[float, int]:
    """(bytes per token, bytes per token group) of one stream of one layer, batch 1, from a real encoding."""
    g = codec.token_group
    x = torch.randn(1, shape.kv_heads, g, shape.head_dim, generator=torch.Generator().manual_seed(0)).to(
        shape.dtype
    )
    enc = codec.encode(x)
    tok = sum(t.numel() * t.element_size() for t in enc.token.values())
    grp = sum(t.numel() * t.element_size() for t in enc.group.values())
    return tok / g, grp


def stream_layout(
    seen: int,
    *,
    lossy: bool,
    residual: int,
    unit: int,
    group: int = 1,
    window: int | None = None,
    prefill: int = 0,
) -> tuple[int, int, int]:
    """``(encoded tokens, encoded groups, full-precision tokens)`` one K or V stream holds after
    ``seen`` non-sink tokens arrived — the accounting of :class:`kvslim.cache.layer.Stream`.

    The newest ``residual`` tokens stay at full precision; older ones leave the residual ``unit``
    (the config's ``group_size``) at a time and are encoded (so ``residual + (seen - residual) % unit``
    stay at full precision). ``group`` is the codec's token group: how many encoded tokens share one
    entry of its per-group parts (KIVI's per-channel K scales; 1 for per-token formats).
    StreamingLLM drops the oldest: encoded tokens one at a time, a group's shared part with its last
    token.

    With ``window >= residual + unit - 1`` (or no window) the layout does not depend on how the
    tokens were chunked. With a smaller window, single tokens never fill a unit before they leave,
    so the stream is all full precision — except what a first chunk of ``prefill`` (> 1) stream
    tokens encoded at once, which drains as the window moves on.
    """
    if not lossy:
        return 0, 0, seen if window is None else min(seen, window)
    if window is None or window >= residual + unit - 1:
        encoded = max(0, (seen - residual) // unit) * unit
        evicted = 0 if window is None else max(0, seen - window)
        return encoded - evicted, encoded // group - evicted // group, seen - encoded
    p = min(prefill, seen)
    encoded = max(0, (p - residual) // unit) * unit  # the prefill's one encode
    fp = p - encoded
    evicted = max(0, p - window)
    from_body = min(evicted, encoded)
    fp -= evicted - from_body
    body = encoded - from_body
    steps = seen - p  # then one token at a time: nothing more is encoded, the oldest leave first
    evicted = max(0, body + fp + steps - window)
    gone = min(evicted, body)
    body -= gone
    fp += steps - (evicted - gone)
    from_body += gone
    return body, encoded // group - from_body // group, fp


@dataclass(frozen=True)
class MemoryRow:
    """The bytes of one mode after ``seen`` tokens; ``stored`` tokens are held (sinks + window at most);
    ``elements_per_token``: K/V elements of one stored token (all layers, K and V, the batch)."""

    config: str
    seen: int
    stored: int
    bytes: int
    fp16_full_bytes: int
    fp32_full_bytes: int
    elements_per_token: int = 0

    @property
    def bits_per_element(self) -> float:
        """Bits per stored K/V element, metadata included (the :class:`KVBits` definition, by formula)."""
        elements = self.stored * self.elements_per_token
        return 8 * self.bytes / elements if elements else float("nan")

    @property
    def bytes_per_token(self) -> float:
        """Bytes per stored token (all layers, K and V, metadata included)."""
        return self.bytes / self.stored if self.stored else float("nan")

    @property
    def ratio_fp16(self) -> float:
        """How many times smaller than an fp16 cache holding every token seen."""
        return self.fp16_full_bytes / self.bytes if self.bytes else float("nan")

    @property
    def ratio_fp32(self) -> float:
        return self.fp32_full_bytes / self.bytes if self.bytes else float("nan")


def fp_bytes(residual_dtype: str, codec, shape: ModelShape) -> int:
    """Bytes per element of a stream's full-precision tokens (sinks and residual): the model's dtype for
    a lossless codec; for a lossy one as ``residual_dtype`` says (``auto``: 2 for an fp32 model)."""
    if not codec.lossy or residual_dtype == "model":
        return shape.dtype_bytes
    if residual_dtype == "auto":
        return 2 if shape.dtype_bytes == 4 else shape.dtype_bytes
    return 2  # float16 / bfloat16


def cache_bytes(
    shape: ModelShape, config: CacheConfig, seen: int, *, prefill: int | None = None, batch: int = 1
) -> tuple[int, int]:
    """``(stored tokens, bytes)`` a SlimCache of ``config`` holds after ``seen`` tokens: a first forward
    of ``prefill`` tokens (None: every token on its own), then one token per step.

    Mirrors :class:`kvslim.cache.layer.SlimLayer`: per layer, sinks in their stream's full-precision dtype
    (:func:`fp_bytes`), then per stream
    encoded tokens (token parts per token, group parts per group, as the codec really encodes them)
    and a full-precision residual, plus a float32 ``(H_kv, D)`` mean-centering bias and, for a centered K
    body, one byte per token and head (``kvslim.cache.basis.CENTERED``); and once per cache the fitted rotation
    matrices (:func:`rotation_bytes`). Counts the stored
    tensors only, not the buffers' preallocated slack (see ``SlimCache.nbytes``).
    """
    check_int("seen", seen, 0, "tokens fed to the cache")
    n_sink = min(seen, config.sink_tokens)  # with or without a window, the first tokens are kept apart
    arrived = seen - n_sink
    first = 1 if prefill is None else max(1, min(prefill, seen))
    first_stream = first - min(first, config.sink_tokens)
    # layers kept at keep_format (keep_layers=) store other formats: one count per distinct (K, V) pair
    pairs: dict[tuple[str, str], int] = {}
    for i in range(shape.layers):
        pair = config.layer_formats(i, shape.layers)
        pairs[pair] = pairs.get(pair, 0) + 1
    stored, everything = 0, 0
    for (k_fmt, v_fmt), n_layers in pairs.items():
        total = 0
        stream_len = 0
        for role, fmt in (("k", k_fmt), ("v", v_fmt)):
            codec = cache_codec(config, fmt, role)
            codec.check_head_dim(shape.head_dim)
            # one full-precision token of this stream (its sinks and residual): residual_dtype for a lossy codec
            per_elem_fp = batch * shape.kv_heads * shape.head_dim * fp_bytes(config.residual_dtype, codec, shape)
            total += n_sink * per_elem_fp
            tok_bytes, grp_bytes = _codec_costs(codec, shape)
            body, groups, fp = stream_layout(
                arrived,
                lossy=codec.lossy,
                residual=config.residual_tokens,
                unit=config.group_size,
                group=codec.token_group,
                window=config.window,
                prefill=first_stream,
            )
            total += round(batch * (body * tok_bytes + groups * grp_bytes)) + fp * per_elem_fp
            centered = config.mean_center is not None and k_fmt in MEAN_CENTER_FORMATS
            if role == "k" and centered and codec.token_group == 1:
                total += batch * body * shape.kv_heads  # a byte per token and head: stored centered or not
            stream_len = body + fp
        if config.mean_center is not None and k_fmt in MEAN_CENTER_FORMATS:
            total += shape.kv_heads * shape.head_dim * 4
        stored, everything = n_sink + stream_len, everything + n_layers * total
    return stored, everything + rotation_bytes(shape, config)


def rotation_bytes(shape: ModelShape, config: CacheConfig) -> int:
    """The fitted rotation matrices a cache of ``config`` holds (``rotate='fitted'``; 0 otherwise): one float32
    ``(H_kv, D, D)`` per layer for each of K and V its format encodes (``SlimCache.rotation_nbytes``), once per
    cache whatever the batch and the length."""
    if config.rotate != "fitted":
        return 0
    roles = [(r, f) for r, f in (("k", config.k_format), ("v", config.v_format)) if cache_codec(config, f, r).lossy]
    return len(roles) * shape.layers * shape.kv_heads * shape.head_dim**2 * 4


@dataclass(frozen=True)
class KVBits:
    """What a cache holds per stored K/V element, read from a real cache after ``tokens_seen`` tokens.

    ``bytes``: every stored tensor of every layer's K/V store — codes, scales, zeros, full-precision
    residual and sinks, mean-centering bias (:meth:`SlimCache.live_nbytes`), whatever format each layer
    uses — and the fitted rotation matrices of ``rotate='fitted'`` (:meth:`SlimCache.rotation_nbytes`: a fixed
    cost per cache, which weighs most at short lengths: 2.9 MB for SmolLM2-135M, 0.5 bits per element at 4,096
    tokens). Not counted: the growing buffers' preallocated slack (it depends on how the buffers grew, not
    on the config: ``SlimCache.nbytes()`` has it) and per-cache constants (RoPE tables, per-row
    bookkeeping). ``elements``: stored K/V elements summed over the layers holding K/V, ``stored tokens
    x batch x KV heads x (k_dim + v_dim)``, each layer with its own stored tokens (a sliding layer holds
    fewer).
    """

    tokens_seen: int
    stored_tokens: int
    elements: int
    bytes: int

    @property
    def bits_per_element(self) -> float:
        """``8 * bytes / elements`` (nan for an empty cache): 16.0 for an fp16 cache, 32.0 for fp32."""
        return 8 * self.bytes / self.elements if self.elements else float("nan")

    def record(self) -> dict:
        return {
            "bits_per_element": self.bits_per_element,
            "tokens_seen": self.tokens_seen,
            "stored_tokens": self.stored_tokens,
            "elements": self.elements,
            "bytes": self.bytes,
        }


def kv_bits(cache) -> KVBits:
    """Bits per stored K/V element of ``cache`` as it is now (see :class:`KVBits`).

    A :class:`~kvslim.SlimCache` is read store by store (its stored tensors). A
    :class:`~kvslim.StaticSlimCache` holds its capacity from the first write on, so its bytes are those
    its stored tokens take, by :func:`cache_bytes` (the tokens it keeps and the groups it encodes are a
    SlimCache's with the same config): a compiled run reports the bits an eager one does. Any other
    transformers cache (``DynamicCache``, a test's stand-in) is read from its layers' ``keys`` /
    ``values``, which are all it stores.
    """
    from ..cache.adapter import SlimCache
    from ..cache.static_adapter import StaticSlimCache

    seen = int(cache.get_seq_length())
    if isinstance(cache, SlimCache):
        fed = [s for s in cache.stores() if s.kv_shape is not None]  # a layer not fed yet holds nothing
        elements = sum(s.stored * s.kv_shape[0] * s.kv_shape[1] * (s.kv_shape[2] + s.v_dim) for s in fed)
        if isinstance(cache, StaticSlimCache):
            if not fed:
                return KVBits(seen, 0, 0, 0)
            b, h, d = fed[0].kv_shape
            shape = ModelShape(len(fed), h, d, fed[0].dtype)
            stored, nbytes = cache_bytes(shape, cache.cache_config, seen, batch=b)
            return KVBits(seen, stored, elements, nbytes)
        held = sum(s.live_nbytes() for s in fed) + (cache.rotation_nbytes() if fed else 0)
        return KVBits(seen, cache.stored_tokens(), elements, held)
    elements = nbytes = stored = 0
    for layer in cache.layers:
        for t in (layer.keys, layer.values):
            if t is not None and t.numel():
                elements += t.numel()
                nbytes += t.numel() * t.element_size()
                stored = max(stored, t.shape[-2])
    return KVBits(seen, stored, elements, nbytes)


def longest(current: KVBits | None, cache) -> KVBits:
    """:func:`kv_bits` of ``cache`` if it has seen more tokens than ``current`` (else ``current``): an
    evaluation with runs of several lengths reports its longest."""
    bits = kv_bits(cache)
    return bits if current is None or bits.tokens_seen > current.tokens_seen else current


def memory_table(
    model_config,
    configs: Iterable[str | CacheConfig],
    lengths: Sequence[int] = (1024, 4096, 32768, 131072),
    *,
    dtype: torch.dtype = torch.float32,
    prefill: int | None = None,
    batch: int = 1,
) -> list[MemoryRow]:
    """Bytes of every mode (the reference ``none`` first) at every length, for a model's real shapes.

    ``model_config`` is a transformers config (or a :class:`ModelShape`); ``dtype`` is the dtype the
    model runs in (what ``none``, sinks and residuals are stored in); ``prefill`` the tokens of the
    first forward (None: one token at a time; it matters only for windows shorter than
    ``residual + group - 1``). See :func:`cache_bytes`.
    """
    shape = (
        model_config if isinstance(model_config, ModelShape) else ModelShape.from_config(model_config, dtype)
    )
    rows = []
    for m in resolve_modes(configs):
        for length in lengths:
            stored, nbytes = cache_bytes(shape, m.config, length, prefill=prefill, batch=batch)
            rows.append(
                MemoryRow(
                    m.label,
                    length,
                    stored,
                    nbytes,
                    shape.full_cache_bytes(length, 2, batch),
                    shape.full_cache_bytes(length, 4, batch),
                    shape.full_cache_bytes(1, 1, batch),
                )
            )
    return rows


def memory_records(rows: Sequence[MemoryRow]) -> list[dict]:
    """Group rows by mode into JSON records: config, lengths, bytes, stored_tokens, bytes_per_token,
    bits_per_element, ratios (aligned lists)."""
    out: dict[str, dict] = {}
    for r in rows:
        rec = out.setdefault(
            r.config,
            {
                "config": r.config,
                "lengths": [],
                "bytes": [],
                "stored_tokens": [],
                "bytes_per_token": [],
                "bits_per_element": [],
                "ratio_fp16": [],
                "ratio_fp32": [],
            },
        )
        rec["lengths"].append(r.seen)
        rec["bytes"].append(r.bytes)
        rec["stored_tokens"].append(r.stored)
        rec["bytes_per_token"].append(r.bytes_per_token)
        rec["bits_per_element"].append(r.bits_per_element)
        rec["ratio_fp16"].append(r.ratio_fp16)
        rec["ratio_fp32"].append(r.ratio_fp32)
    return list(out.values())
