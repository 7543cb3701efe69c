"""K mean-centering: calibration (per-(layer, kv-head, channel) K means) and the bias file.

A symmetric block quantizer (q4_0, q5_0, q8_0: ``x ~= scale * q``, no zero point) spends dynamic
range on a channel's constant offset. Subtracting a fixed per-(kv-head, channel) mean ``k_bar``
from every cached key before quantization gives that range back, and is exactly softmax-invariant:
``q . (k_i - k_bar) = q . k_i - q . k_bar`` shifts every logit of a query row by the same constant.
The technique and the file layout come from PrismML's llama.cpp fork (PR #51, ``--kv-mean-center``,
``tools/kv-mean-center``); see docs/mean-center.md.

This module knows how to *measure* ``k_bar`` (:func:`collect_k_means`), how to store it
(:func:`write_bias_file` / :func:`read_bias_file`, GGUF, deterministic bytes) and how to hand it to
a cache, validated against the model's shapes (:func:`load_mean_center`). It does not apply it:
the cache layer subtracts the bias (see :mod:`kvslim.cache`).

Calibration captures exactly the tensor the cache stores: the ``key_states`` a transformers
attention layer passes to ``Cache.update`` (post-RoPE), through a tiny collecting ``Cache``
(:class:`KMeanCollector`), so no model-specific hook is needed. As in llama.cpp's tool, the text is
run in independent chunks of ``ctx`` tokens (a fresh cache per chunk); sums are float64.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

#: ``general.type`` of a bias file (the fork's value).
FILE_TYPE = "kv-mean-center"
#: ``kv_mean_center.schema_version`` this module writes and reads.
SCHEMA_VERSION = 1
#: Prefix of the fork's metadata keys.
KEY_PREFIX = "kv_mean_center."
#: ``kv_mean_center.model_sha256_kind``: whose identity ``model_sha256`` holds.
FINGERPRINT_KIND = "kvslim"
_TENSOR_RE = re.compile(r"^kv_bar\.blk\.(\d+)\.k$")


def tensor_name(layer: int) -> str:
    """The GGUF tensor name of layer ``layer``'s K bias (the fork's naming)."""
    return f"kv_bar.blk.{layer}.k"


# ----------------------------------------------------------------------------------------------
# The bias set


@dataclass(eq=False)
class KStats:
    """Spread of the calibrated K, for judging whether centering can help (not stored in files).

    row_norm_mean: per layer, ``(H_kv,)`` float64: mean over tokens of ``||k_{t,h}||``.
    channel_std: per layer, ``(H_kv, D)`` float64: standard deviation over tokens of each channel.
    """

    row_norm_mean: list[torch.Tensor]
    channel_std: list[torch.Tensor]


@dataclass(eq=False)
class BiasSet:
    """Per-layer K biases and where they came from.

    tensors: one float32 tensor ``(H_kv, D)`` per attention layer, index = model layer index.
        A set read from a file whose tensors are 1-D (the fork writes 1-D) holds ``(H_kv * D,)``
        tensors unless :func:`read_bias_file` was given the head shape.
    k_rot: the basis: True if K was calibrated after a Hadamard rotation (no kvslim option
        rotates K yet, so kvslim always writes False).
    model_fingerprint: kvslim's model fingerprint, ``sha256:<64 hex>`` (see :func:`model_fingerprint`),
        stored as the bare hex digits in ``kv_mean_center.model_sha256``; None if unknown (also for
        a file whose ``model_sha256`` is another tool's identity, e.g. the fork's GGUF-file hash).
    cache_type: the K storage format the bias was calibrated for (e.g. ``q4_0``); None if unknown.
    channel_order: ``transformers`` (the K channel order of the transformers model, what kvslim's
        cache stores), ``llama.cpp`` (permuted for llama.cpp, see :func:`to_llama_cpp_order`), or
        None if unknown (a fork-written file: llama.cpp's order).
    n_tokens, text_sha256, ctx, n_chunks: the calibration run (tokens used, sha256 of the text's
        UTF-8 bytes, chunk length, number of chunks); None if unknown (e.g. a fork-written file).
    stats: K spread measured during calibration (in memory only, never written).
    """

    tensors: list[torch.Tensor]
    k_rot: bool = False
    model_fingerprint: str | None = None
    cache_type: str | None = None
    channel_order: str | None = "transformers"
    n_tokens: int | None = None
    text_sha256: str | None = None
    ctx: int | None = None
    n_chunks: int | None = None
    stats: KStats | None = field(default=None, repr=False)

    @property
    def n_layers(self) -> int:
        return len(self.tensors)

    def metadata(self) -> dict:
        """Everything but the tensors, as a plain dict."""
        return {
            "k_rot": self.k_rot,
            "model_fingerprint": self.model_fingerprint,
            "cache_type": self.cache_type,
            "channel_order": self.channel_order,
            "n_tokens": self.n_tokens,
            "text_sha256": self.text_sha256,
            "ctx": self.ctx,
            "n_chunks": self.n_chunks,
        }

    def summary_rows(self) -> list[dict]:
        """Per layer: ``bias_norm`` (L2 over the whole ``(H_kv, D)`` bias) and, when ``stats`` are
        known, ``k_row_norm`` (mean ``||k||`` over tokens and heads) and ``ratio``
        (mean over heads of ``||k_bar_h||`` / ``k_row_norm``, in [0, 1] by Jensen: 0 = K already
        zero-mean, centering cannot help; near 1 = K is mostly its mean)."""
        rows = []
        for il, t in enumerate(self.tensors):
            t64 = t.double()
            row = {"layer": il, "bias_norm": float(t64.norm())}
            if self.stats is not None:
                k_norm = float(self.stats.row_norm_mean[il].mean())
                head_bias = float(t64.reshape(self.stats.row_norm_mean[il].numel(), -1).norm(dim=-1).mean())
                row["k_row_norm"] = k_norm
                row["ratio"] = head_bias / k_norm if k_norm > 0 else float("nan")
            rows.append(row)
        return rows


# ----------------------------------------------------------------------------------------------
# Collecting the means


class _KSums:
    """float64 running sums per layer: sum and sum of squares of K per (head, channel), sum of K
    row norms per head, and the token count."""

    def __init__(self):
        self.sum: dict[int, torch.Tensor] = {}
        self.sumsq: dict[int, torch.Tensor] = {}
        self.norm: dict[int, torch.Tensor] = {}
        self.count: dict[int, int] = {}

    def add(self, layer: int, keys: torch.Tensor) -> None:
        """keys: ``(B, H_kv, T, D)``, unpadded (every row is a real token)."""
        k = keys.detach().to(torch.float64)
        s = k.sum(dim=(0, 2))  # (H_kv, D)
        sq = (k * k).sum(dim=(0, 2))  # (H_kv, D)
        n = torch.linalg.vector_norm(k, dim=-1).sum(dim=(0, 2))  # (H_kv,)
        if layer in self.sum:
            self.sum[layer] += s
            self.sumsq[layer] += sq
            self.norm[layer] += n
            self.count[layer] += k.shape[0] * k.shape[2]
        else:
            self.sum[layer], self.sumsq[layer], self.norm[layer] = s, sq, n
            self.count[layer] = k.shape[0] * k.shape[2]

    def means(self, n_layers: int) -> tuple[list[torch.Tensor], KStats]:
        missing = [il for il in range(n_layers) if not self.count.get(il)]
        if missing:
            raise ValueError(
                f"layers {missing} received no keys during calibration; only models whose every layer "
                f"is a standard attention layer are supported (not hybrid or KV-sharing models)"
            )
        means, norms, stds = [], [], []
        for il in range(n_layers):
            n = self.count[il]
            mean = self.sum[il] / n
            var = (self.sumsq[il] / n - mean * mean).clamp_min(0.0)
            means.append(mean.to(torch.float32).cpu())
            norms.append((self.norm[il] / n).cpu())
            stds.append(var.sqrt().cpu())
        return means, KStats(row_norm_mean=norms, channel_std=stds)


@functools.cache
def _layer_classes():
    from transformers.cache_utils import Cache, DynamicLayer

    class KMeanLayer(DynamicLayer):
        """A DynamicLayer that also adds every stored key to the running sums."""

        def __init__(self, sums: _KSums, layer_idx: int):
            super().__init__()
            self.sums = sums
            self.layer_idx = layer_idx

        def update(self, key_states, value_states, *args, **kwargs):
            # key_states: (B, H_kv, T, D), exactly what a cache would store for these tokens.
            self.sums.add(self.layer_idx, key_states)
            return super().update(key_states, value_states, *args, **kwargs)

    class KMeanCollector(Cache):
        """A transformers ``Cache`` for one calibration chunk: stores K/V like ``DynamicCache`` (so
        attention inside the chunk is exact) and adds every key to ``sums``, which outlive it."""

        def __init__(self, sums: _KSums, n_layers: int):
            super().__init__(layers=[KMeanLayer(sums, il) for il in range(n_layers)])
            self.sums = sums

    return KMeanLayer, KMeanCollector


def __getattr__(name):
    # The Cache subclasses import transformers (seconds): built on first use, not at import.
    if name in ("KMeanLayer", "KMeanCollector"):
        layer_cls, cache_cls = _layer_classes()
        return layer_cls if name == "KMeanLayer" else cache_cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def chunk_spans(n_tokens: int, ctx: int, *, chunks: int | None = None, max_tokens: int | None = None):
    """The ``[start, end)`` token spans calibration runs.

    The first ``max_tokens`` tokens (all if None) are cut into chunks of ``ctx`` tokens. A final
    partial chunk is dropped when at least one full chunk exists (every chunk then sees the same
    positions, as in llama.cpp's tools); a text shorter than ``ctx`` is used whole as one chunk.
    ``chunks`` keeps only the first ``chunks`` spans.
    """
    _positive("ctx", ctx)
    if chunks is not None:
        _positive("chunks", chunks)
    if max_tokens is not None:
        _positive("max_tokens", max_tokens)
    n = n_tokens if max_tokens is None else min(n_tokens, max_tokens)
    if n <= 0:
        raise ValueError("the calibration text has no tokens")
    full = n // ctx
    spans = [(i * ctx, (i + 1) * ctx) for i in range(full)] if full else [(0, n)]
    return spans if chunks is None else spans[:chunks]


def _positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _n_layers(model) -> int:
    config = model.config
    if hasattr(config, "get_text_config"):
        config = config.get_text_config(decoder=True)
    return int(config.num_hidden_layers)


def collect_k_means_from_ids(
    model,
    input_ids,
    *,
    ctx: int = 512,
    chunks: int | None = None,
    max_tokens: int | None = None,
    progress: bool = True,
    cache_type: str = "q4_0",
    text_sha256: str | None = None,
    fingerprint: str | None = None,
) -> BiasSet:
    """Mean of the cached K per (layer, kv-head, channel) over a token sequence.

    input_ids: ``(T,)`` or ``(1, T)`` token ids (one unpadded sequence).
    ctx, chunks, max_tokens: how the tokens are cut (see :func:`chunk_spans`); each chunk runs
        through the model with a fresh cache, so positions restart at 0 in every chunk.
    cache_type: recorded in the result (the K format the bias is meant for).
    text_sha256: recorded in the result (:func:`collect_k_means` passes the text's sha256).
    fingerprint: the model fingerprint to record; None computes :func:`model_fingerprint`.
    Returns a :class:`BiasSet` with ``(H_kv, D)`` float32 means and :class:`KStats`.
    """
    from tqdm.auto import tqdm

    ids = torch.as_tensor(input_ids)
    if ids.dim() == 2 and ids.shape[0] == 1:
        ids = ids[0]
    if ids.dim() != 1:
        raise ValueError(f"input_ids must be one sequence, shape (T,) or (1, T); got {tuple(ids.shape)}")
    if ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise ValueError(f"input_ids must be integer token ids, got dtype {ids.dtype}")
    spans = chunk_spans(ids.numel(), ctx, chunks=chunks, max_tokens=max_tokens)
    n_layers = _n_layers(model)
    device = next(model.parameters()).device
    _, collector_cls = _layer_classes()
    sums = _KSums()
    n_used = sum(e - s for s, e in spans)
    was_training = model.training
    model.eval()  # no dropout in the measured keys
    try:
        with (
            torch.inference_mode(),
            tqdm(total=n_used, unit="tok", desc="calibrating", disable=not progress, leave=False) as bar,
        ):
            for start, end in spans:
                chunk = ids[start:end].to(device)[None]  # (1, T_chunk)
                cache = collector_cls(sums, n_layers)  # cleared per chunk, sums carried over
                model(input_ids=chunk, cache=cache, use_cache=True, logits_to_keep=1)
                bar.update(end - start)
    finally:
        model.train(was_training)
    means, stats = sums.means(n_layers)
    return BiasSet(
        tensors=means,
        k_rot=False,
        model_fingerprint=model_fingerprint(model) if fingerprint is None else fingerprint,
        cache_type=cache_type,
        n_tokens=n_used,
        text_sha256=text_sha256,
        ctx=ctx,
        n_chunks=len(spans),
        stats=stats,
    )


def collect_k_means(
    model,
    tokenizer,
    text: str,
    *,
    ctx: int = 512,
    chunks: int | None = None,
    max_tokens: int | None = None,
    progress: bool = True,
    cache_type: str = "q4_0",
    fingerprint: str | None = None,
) -> BiasSet:
    """Calibrate on ``text``: tokenized once as a whole with the tokenizer's defaults (special
    tokens as ``tokenizer(text)`` adds them), then :func:`collect_k_means_from_ids`."""
    if not isinstance(text, str):
        raise ValueError(f"text must be a str, got {type(text).__name__}")
    ids = tokenizer(text)["input_ids"]
    return collect_k_means_from_ids(
        model,
        torch.tensor(ids, dtype=torch.long),
        ctx=ctx,
        chunks=chunks,
        max_tokens=max_tokens,
        progress=progress,
        cache_type=cache_type,
        text_sha256=hashlib.sha256(text.encode("utf-8")).hexdigest(),
        fingerprint=fingerprint,
    )


# ----------------------------------------------------------------------------------------------
# Model fingerprint


def model_fingerprint(model) -> str:
    """A stable identity of the model's weights, ``sha256:<64 hex>``.

    Uses :func:`kvslim.models.model_fingerprint` when that module provides one, else
    :func:`_fallback_fingerprint`. Either way it is kvslim's fingerprint, not the fork's (which
    hashes the GGUF file bytes): files record which one they hold
    (``kv_mean_center.model_sha256_kind``), and only kvslim's is compared.
    """
    try:
        from .models import model_fingerprint as fingerprint
    except ImportError:
        fingerprint = _fallback_fingerprint
    return fingerprint(model)


def _fallback_fingerprint(model) -> str:
    """sha256 over every parameter and buffer, in name order: name, dtype, shape and raw bytes
    (buffers include RoPE's ``inv_freq``, which shapes the post-RoPE keys). Config values that
    live in no tensor (e.g. ``rms_norm_eps``) are not covered."""
    h = hashlib.sha256(b"kvslim.model-fingerprint.v1\0")
    named = dict(model.named_parameters())
    named.update({f"buffer:{k}": v for k, v in model.named_buffers()})
    for name in sorted(named):
        t = named[name].detach()
        h.update(f"{name}\0{t.dtype}\0{tuple(t.shape)}\0".encode())
        h.update(t.cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return "sha256:" + h.hexdigest()


_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def _fingerprint_hex(fingerprint: str) -> str:
    """``sha256:<hex>`` (or bare hex) -> the 64 lowercase hex digits the fork's format stores."""
    digits = fingerprint.lower().removeprefix("sha256:")
    if not _HEX64.match(digits):
        raise ValueError(f"model_fingerprint must be 'sha256:' + 64 hex digits, got {fingerprint!r}")
    return digits


# ----------------------------------------------------------------------------------------------
# Channel order: transformers vs llama.cpp

#: ``kv_mean_center.channel_order`` values.
CHANNEL_ORDERS = ("transformers", "llama.cpp")
#: model_type -> whether llama.cpp's GGUF converter permutes k_proj rows for it. llama.cpp runs these
#: archs with interleaved ("normal") RoPE, pairs (2i, 2i+1), so convert_hf_to_gguf.py permutes the
#: q/k rows of transformers' rotate-half layout, pairs (i, i + D/2); NEOX-RoPE archs keep the order.
LLAMA_CPP_PERMUTES_K = {
    "llama": True, "mistral": True, "mixtral": True,
    "qwen2": False, "qwen3": False, "qwen2_moe": False, "qwen3_moe": False, "phi3": False,
    "gemma": False, "gemma2": False, "gemma3_text": False, "stablelm": False,
}  # fmt: skip


def _permutes(model_type: str) -> bool:
    if model_type not in LLAMA_CPP_PERMUTES_K:
        raise ValueError(
            f"unknown whether llama.cpp permutes the K channels of model_type {model_type!r}; "
            f"known: {', '.join(sorted(LLAMA_CPP_PERMUTES_K))}"
        )
    return LLAMA_CPP_PERMUTES_K[model_type]


def _two_d(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    for il, t in enumerate(tensors):
        if t.dim() != 2 or t.shape[1] % 2:
            raise ValueError(
                f"{tensor_name(il)}: channel reordering needs (H_kv, D) tensors with an even D, got "
                f"shape {tuple(t.shape)} (read 1-D files with read_bias_file(..., n_kv_heads=, head_dim=))"
            )
    return tensors


def to_llama_cpp_order(bias: BiasSet, model_type: str) -> BiasSet:
    """The same biases with each head's channels in llama.cpp's order for ``model_type``.

    For llama-arch models (Llama, Mistral, SmolLM2) channel ``2i + r`` of llama.cpp's K is channel
    ``r * D/2 + i`` of transformers' K (the converter's q/k permutation, which transformers' GGUF
    loader undoes); other known archs keep the order. Tensors must be ``(H_kv, D)``.
    """
    if bias.channel_order != CHANNEL_ORDERS[0]:
        raise ValueError(f"expected a bias in {CHANNEL_ORDERS[0]!r} order, got {bias.channel_order!r}")
    tensors = _two_d(bias.tensors)
    if _permutes(model_type):
        # (H, D) -> (H, 2, D/2)[h, r, i] -> (H, D/2, 2)[h, i, r] -> index 2i + r
        tensors = [t.reshape(t.shape[0], 2, -1).transpose(1, 2).reshape(t.shape) for t in tensors]
    return dataclasses.replace(bias, tensors=tensors, channel_order=CHANNEL_ORDERS[1])


def from_llama_cpp_order(bias: BiasSet, model_type: str) -> BiasSet:
    """Inverse of :func:`to_llama_cpp_order` (also for a fork-written file, whose order is llama.cpp's)."""
    if bias.channel_order not in (None, CHANNEL_ORDERS[1]):
        raise ValueError(f"expected a bias in {CHANNEL_ORDERS[1]!r} order, got {bias.channel_order!r}")
    tensors = _two_d(bias.tensors)
    if _permutes(model_type):
        tensors = [t.reshape(t.shape[0], -1, 2).transpose(1, 2).reshape(t.shape) for t in tensors]
    return dataclasses.replace(bias, tensors=tensors, channel_order=CHANNEL_ORDERS[0])


# ----------------------------------------------------------------------------------------------
# GGUF file


def write_bias_file(path: str | os.PathLike, bias: BiasSet) -> None:
    """Write ``bias`` as a GGUF file in the fork's layout plus kvslim's provenance keys.

    Keys, in this order: ``general.type`` = ``kv-mean-center``, ``kv_mean_center.schema_version``
    (u32, 1), ``kv_mean_center.model_sha256`` (kvslim's fingerprint as 64 hex digits, when known),
    ``kv_mean_center.k_rot`` (bool), then ``model_sha256_kind`` (str, ``kvslim``, with the
    fingerprint), ``cache_type`` (str), ``channel_order`` (str), ``n_tokens`` (u64),
    ``text_sha256`` (str), ``ctx`` (u32), ``n_chunks`` (u32) under ``kv_mean_center.``, each when
    known. Tensors ``kv_bar.blk.<il>.k``, F32, in layer order, numpy shape ``(H_kv, D)`` = GGUF
    ``ne=[D, H_kv]`` (channel fastest; the fork writes the same bytes as 1-D ``ne=[D*H_kv]``).
    No timestamps: the same BiasSet gives the same bytes.
    """
    from gguf import GGUFWriter

    if not bias.tensors:
        raise ValueError("the bias set has no tensors")
    arrays = []
    for il, t in enumerate(bias.tensors):
        t = torch.as_tensor(t)
        if t.dim() not in (1, 2) or not t.dtype.is_floating_point:
            raise ValueError(
                f"{tensor_name(il)}: expected a 1-D or 2-D float tensor (H_kv, D), got "
                f"shape {tuple(t.shape)} dtype {t.dtype}"
            )
        a = t.detach().to(torch.float32).cpu().contiguous().numpy()
        if not np.isfinite(a).all():
            raise ValueError(f"{tensor_name(il)} has {int((~np.isfinite(a)).sum())} non-finite values")
        arrays.append(a)
    # arch="" keeps general.architecture out (GGUFWriter skips empty strings): a bias file is not
    # a model, and the fork's files have no such key.
    writer = GGUFWriter(os.fspath(path), arch="")
    writer.add_type(FILE_TYPE)
    writer.add_uint32(KEY_PREFIX + "schema_version", SCHEMA_VERSION)
    fingerprint = _fingerprint_hex(bias.model_fingerprint) if bias.model_fingerprint else None
    if fingerprint:
        writer.add_string(KEY_PREFIX + "model_sha256", fingerprint)
    writer.add_bool(KEY_PREFIX + "k_rot", bool(bias.k_rot))
    if fingerprint:
        writer.add_string(KEY_PREFIX + "model_sha256_kind", FINGERPRINT_KIND)
    if bias.cache_type:
        writer.add_string(KEY_PREFIX + "cache_type", bias.cache_type)
    if bias.channel_order:
        writer.add_string(KEY_PREFIX + "channel_order", bias.channel_order)
    if bias.n_tokens is not None:
        writer.add_uint64(KEY_PREFIX + "n_tokens", int(bias.n_tokens))
    if bias.text_sha256:
        writer.add_string(KEY_PREFIX + "text_sha256", bias.text_sha256)
    if bias.ctx is not None:
        writer.add_uint32(KEY_PREFIX + "ctx", int(bias.ctx))
    if bias.n_chunks is not None:
        writer.add_uint32(KEY_PREFIX + "n_chunks", int(bias.n_chunks))
    for il, a in enumerate(arrays):
        writer.add_tensor(tensor_name(il), a)
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()


def _read_raw(path: str | os.PathLike) -> tuple[dict[int, np.ndarray], dict]:
    """Layer index -> float32 array (numpy order, 1-D or ``(H_kv, D)``) and the BiasSet metadata.
    Raises ValueError for a file that is not a schema-1 kv-mean-center GGUF or holds a tensor that
    is not an F32 ``kv_bar.blk.<il>.k``."""
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType

    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"bias file {path!r} does not exist")
    try:
        reader = GGUFReader(path)
    except Exception as e:  # the reader raises ValueError, struct.error, IndexError, ...
        raise ValueError(f"{path}: not a readable GGUF file ({e})") from None

    def value(key, expected: tuple):
        f = reader.get_field(key)
        if f is None:
            return None
        if not f.types or f.types[0] not in expected:
            got = f.types[0].name if f.types else "empty"
            raise ValueError(
                f"{path}: {key} has type {got}, expected {' or '.join(t.name for t in expected)}"
            )
        return f.contents()

    ints = (
        GGUFValueType.UINT8, GGUFValueType.UINT16, GGUFValueType.UINT32, GGUFValueType.UINT64,
        GGUFValueType.INT8, GGUFValueType.INT16, GGUFValueType.INT32, GGUFValueType.INT64,
    )  # fmt: skip
    strings = (GGUFValueType.STRING,)
    ftype = value("general.type", strings)
    if ftype != FILE_TYPE:
        raise ValueError(
            f"{path}: general.type is {ftype!r}, expected {FILE_TYPE!r} (not a K mean-centering file)"
        )
    version = value(KEY_PREFIX + "schema_version", ints)
    # The fork's own writer records no schema version (a later fork adds it, = 1): absent is schema 1.
    if version is not None and int(version) != SCHEMA_VERSION:
        raise ValueError(
            f"{path}: kv_mean_center.schema_version is {int(version)}, this kvslim reads {SCHEMA_VERSION}"
        )
    k_rot = value(KEY_PREFIX + "k_rot", (GGUFValueType.BOOL,))
    meta = {
        "k_rot": None if k_rot is None else bool(k_rot),
        "model_fingerprint": None,
        "cache_type": value(KEY_PREFIX + "cache_type", strings),
        "channel_order": value(KEY_PREFIX + "channel_order", strings),
        "n_tokens": value(KEY_PREFIX + "n_tokens", ints),
        "text_sha256": value(KEY_PREFIX + "text_sha256", strings),
        "ctx": value(KEY_PREFIX + "ctx", ints),
        "n_chunks": value(KEY_PREFIX + "n_chunks", ints),
    }
    # model_sha256 is kvslim's fingerprint only when the file says so; the fork stores a hash of
    # the model's GGUF file bytes there, which kvslim cannot recompute from a loaded model.
    sha = value(KEY_PREFIX + "model_sha256", strings)
    if sha and value(KEY_PREFIX + "model_sha256_kind", strings) == FINGERPRINT_KIND:
        meta["model_fingerprint"] = "sha256:" + _fingerprint_hex(sha)
    for key in ("n_tokens", "ctx", "n_chunks"):
        if meta[key] is not None:
            meta[key] = int(meta[key])
    layers: dict[int, np.ndarray] = {}
    for t in reader.tensors:
        m = _TENSOR_RE.match(t.name)
        if m is None:
            raise ValueError(
                f"{path}: unexpected tensor {t.name!r}; a bias file holds only kv_bar.blk.<il>.k"
            )
        if t.tensor_type != GGMLQuantizationType.F32:
            raise ValueError(f"{path}: {t.name} has type {t.tensor_type.name}, expected F32")
        if len(t.shape) > 2:
            raise ValueError(
                f"{path}: {t.name} has {len(t.shape)} dimensions (ne={list(map(int, t.shape))}), "
                f"expected 1 (ne=[D*H_kv]) or 2 (ne=[D, H_kv])"
            )
        # reader.tensors' data is numpy order (ne reversed): ne=[D, H] -> (H, D). Copy off the memmap.
        layers[int(m.group(1))] = np.array(t.data, dtype=np.float32, copy=True)
    if not layers:
        raise ValueError(f"{path}: no kv_bar.blk.<il>.k tensors")
    return layers, meta


def read_bias_file(
    path: str | os.PathLike, *, n_kv_heads: int | None = None, head_dim: int | None = None
) -> BiasSet:
    """Read a bias file (kvslim's or the fork's). Tensors come back as stored: ``(H_kv, D)`` for
    2-D tensors, ``(H_kv * D,)`` for 1-D ones unless ``n_kv_heads`` and ``head_dim`` are given
    (then every tensor is validated and reshaped to ``(H_kv, D)``). Layers must be 0..n-1;
    a gap raises (use :func:`load_mean_center` for validation against a model)."""
    layers, meta = _read_raw(path)
    missing = sorted(set(range(max(layers) + 1)) - set(layers))
    if missing:
        raise ValueError(
            f"{os.fspath(path)}: {tensor_name(missing[0])} missing; the file's layers are "
            f"{sorted(layers)} (not 0..{max(layers)})"
        )
    tensors = [torch.from_numpy(layers[il]) for il in range(len(layers))]
    if n_kv_heads is not None or head_dim is not None:
        if n_kv_heads is None or head_dim is None:
            raise ValueError("give both n_kv_heads and head_dim, or neither")
        tensors = [
            _check_layer(t, il, n_kv_heads, head_dim, where=os.fspath(path)) for il, t in enumerate(tensors)
        ]
    return BiasSet(tensors=tensors, **{**meta, "k_rot": bool(meta["k_rot"])})


# ----------------------------------------------------------------------------------------------
# Loading for a cache


def _check_layer(t, il: int, n_kv_heads: int, head_dim: int, *, where: str) -> torch.Tensor:
    """Validate one layer's bias and return it as a float32 ``(H_kv, D)`` tensor."""
    name = tensor_name(il)
    if isinstance(t, np.ndarray):
        t = torch.from_numpy(t)
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} ({where}): expected a tensor, got {type(t).__name__}")
    if not t.dtype.is_floating_point:
        raise ValueError(
            f"{name} ({where}): dtype {t.dtype}, expected a floating point tensor (F32 in files)"
        )
    expected = n_kv_heads * head_dim
    if t.numel() != expected:
        raise ValueError(
            f"{name} ({where}): {t.numel()} elements, expected {expected} "
            f"(head_dim {head_dim} x n_kv_heads {n_kv_heads})"
        )
    if t.dim() == 2 and tuple(t.shape) != (n_kv_heads, head_dim):
        raise ValueError(
            f"{name} ({where}): shape {tuple(t.shape)}, expected ({n_kv_heads}, {head_dim}) "
            f"(n_kv_heads, head_dim; GGUF ne=[{head_dim}, {n_kv_heads}]) or 1-D ({expected},)"
        )
    if t.dim() not in (1, 2):
        raise ValueError(f"{name} ({where}): {t.dim()} dimensions, expected 1 or 2")
    t = t.detach().to(torch.float32).reshape(n_kv_heads, head_dim)  # channel fastest
    bad = int((~torch.isfinite(t)).sum())
    if bad:
        raise ValueError(f"{name} ({where}): {bad} non-finite values")
    return t


def load_mean_center(
    value,
    *,
    n_layers: int,
    n_kv_heads: int | Sequence[int],
    head_dim: int | Sequence[int],
    model_fingerprint: str | None = None,
    k_rot: bool = False,
    dtype: torch.dtype = torch.float32,
) -> list[torch.Tensor]:
    """Per-layer K biases for a cache, validated against the model's shapes.

    value: a bias file path (str / PathLike), a :class:`BiasSet`, or a list of per-layer tensors
        (each ``(H_kv, D)`` or 1-D ``(H_kv * D,)``, channel fastest).
    n_layers, n_kv_heads, head_dim: the model's (``n_kv_heads`` / ``head_dim`` may be per-layer lists).
    model_fingerprint: the model's fingerprint; checked against the file's only when both are known.
    k_rot: the basis the cache stores K in; a file recording another basis is refused (as the fork does).
    Returns ``n_layers`` tensors ``(H_kv, D)`` in ``dtype`` on the CPU.
    Raises ValueError naming the tensor and what was expected vs found: a missing or extra layer, a
    wrong element count, shape or dtype, non-finite values, a basis or fingerprint mismatch.
    """
    _positive("n_layers", n_layers)
    heads = _per_layer("n_kv_heads", n_kv_heads, n_layers)
    dims = _per_layer("head_dim", head_dim, n_layers)
    meta: dict = {}
    if isinstance(value, (str, os.PathLike)):
        where = os.fspath(value)
        layers, meta = _read_raw(value)
    elif isinstance(value, BiasSet):
        where = "the given BiasSet"
        layers, meta = dict(enumerate(value.tensors)), value.metadata()
    elif isinstance(value, (list, tuple)):
        where = "the given tensors"
        layers = dict(enumerate(value))
    else:
        raise ValueError(
            f"mean_center must be a bias file path, a BiasSet or a list of per-layer tensors; "
            f"got {type(value).__name__}"
        )
    file_k_rot = meta.get("k_rot")
    if file_k_rot is not None and bool(file_k_rot) != bool(k_rot):
        basis = {True: "rotated (k_rot=true)", False: "unrotated (k_rot=false)"}
        raise ValueError(
            f"{where} was calibrated in the {basis[bool(file_k_rot)]} K basis, but this cache stores K "
            f"{basis[bool(k_rot)]}; recalibrate with matching settings"
        )
    if meta.get("channel_order") not in (None, CHANNEL_ORDERS[0]):
        raise ValueError(
            f"{where} holds K channels in {meta['channel_order']!r} order, kvslim's cache stores them in "
            f"{CHANNEL_ORDERS[0]!r} order; use a file calibrated without --llama-cpp-order "
            f"(or convert it with kvslim.calibrate.from_llama_cpp_order)"
        )
    file_fp = meta.get("model_fingerprint")
    if file_fp and model_fingerprint and _fingerprint_hex(file_fp) != _fingerprint_hex(model_fingerprint):
        raise ValueError(
            f"{where} was calibrated for another model: its fingerprint is {file_fp[:23]}..., "
            f"this model's is {model_fingerprint[:23]}...; recalibrate for this model"
        )
    extra = sorted(il for il in layers if il >= n_layers)
    if extra:
        raise ValueError(
            f"{tensor_name(extra[0])} present in {where}, but the model has {n_layers} layers "
            f"(0..{n_layers - 1}); the file has {len(layers)} layers"
        )
    for il in range(n_layers):
        if il not in layers:
            raise ValueError(
                f"{tensor_name(il)} missing; {where} has {len(layers)} layers, the model has {n_layers}"
            )
    return [
        _check_layer(layers[il], il, heads[il], dims[il], where=where).to(dtype) for il in range(n_layers)
    ]


def _per_layer(name: str, value, n_layers: int) -> list[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        values = [value] * n_layers
    elif isinstance(value, Sequence) and not isinstance(value, str):
        values = list(value)
        if len(values) != n_layers:
            raise ValueError(f"{name} has {len(values)} entries, expected one per layer ({n_layers})")
    else:
        raise ValueError(f"{name} must be a positive int or a list of them, got {value!r}")
    for v in values:
        _positive(name, v)
    return values
