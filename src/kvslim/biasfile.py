"""The K mean-centering bias file: GGUF in the layout of PrismML's llama.cpp fork, deterministic bytes.

The fork (PrismML-Eng/llama.cpp PR #51, ``--kv-mean-center``, ``common/kv-mean-center.cpp``) stores
one F32 tensor ``kv_bar.blk.<il>.k`` of ``head_dim * n_kv_heads`` values per layer, channel fastest,
next to ``general.type = kv-mean-center``, ``kv_mean_center.schema_version``, ``model_sha256`` and
``k_rot``. kvslim writes the same keys and bytes and adds its provenance keys (cache type, channel
order, calibration text and chunks); it reads files of either tool. See docs/mean-center.md.

Deterministic files (as gguf-py's imatrix): tensors in layer order, keys in a fixed order, no
timestamps, so the same :class:`~kvslim.meancenter.BiasSet` always gives the same bytes.

Deviation from the fork: for llama-arch models llama.cpp's converter permutes the K channels
(interleaved vs rotate-half RoPE), so a bias is only portable after :func:`to_llama_cpp_order` /
:func:`from_llama_cpp_order`; files record their order (``kv_mean_center.channel_order``).

This module knows the bytes and names of the file; it does not check a bias against a model's
shapes (:func:`kvslim.meancenter.load_mean_center` does), measure one (:mod:`kvslim.calibrate`) or
apply one (the cache layer does).
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from .meancenter import BiasSet

#: ``general.type`` of a bias file (the fork's value).
FILE_TYPE = "kv-mean-center"
#: ``kv_mean_center.schema_version`` this module writes and reads.
SCHEMA_VERSION = 1
#: Prefix of the fork's metadata keys.
KEY_PREFIX = "kv_mean_center."
#: ``kv_mean_center.model_sha256_kind``: whose identity ``model_sha256`` holds.
FINGERPRINT_KIND = "kvslim"
#: ``kv_mean_center.channel_order`` values: kvslim's cache order, and llama.cpp's.
CHANNEL_ORDERS = ("transformers", "llama.cpp")
_TENSOR_RE = re.compile(r"^kv_bar\.blk\.(\d+)\.k$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def tensor_name(layer: int) -> str:
    """The GGUF tensor name of layer ``layer``'s K bias (the fork's naming)."""
    return f"kv_bar.blk.{layer}.k"


def fingerprint_hex(fingerprint: str) -> str:
    """``sha256:<hex>`` (or bare hex) -> the 64 lowercase hex digits the fork's format stores."""
    digits = fingerprint.lower().removeprefix("sha256:")
    if not _HEX64.match(digits):
        raise ValueError(f"model_fingerprint must be 'sha256:' + 64 hex digits, got {fingerprint!r}")
    return digits


# ----------------------------------------------------------------------------------------------
# Writing


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
    fingerprint = fingerprint_hex(bias.model_fingerprint) if bias.model_fingerprint else None
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


# ----------------------------------------------------------------------------------------------
# Reading


def read_layers(path: str | os.PathLike) -> tuple[dict[int, np.ndarray], dict]:
    """Layer index -> float32 array (numpy order, 1-D or ``(H_kv, D)``) and the BiasSet metadata
    (:meth:`~kvslim.meancenter.BiasSet.metadata`'s keys; ``k_rot`` None when the file has none).

    Raises FileNotFoundError for a missing file, ValueError for a file that is not a schema-1
    kv-mean-center GGUF or holds a tensor that is not an F32 ``kv_bar.blk.<il>.k``. Layers are
    returned as found (a gap or a count that does not fit the model is the caller's to judge).
    """
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
        meta["model_fingerprint"] = "sha256:" + fingerprint_hex(sha)
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
    a gap raises (use :func:`kvslim.meancenter.load_mean_center` for validation against a model)."""
    # meancenter imports this module (a cache loads bias files through it): import it at call time.
    from .meancenter import BiasSet, check_layer

    layers, meta = read_layers(path)
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
            check_layer(t, il, n_kv_heads, head_dim, where=os.fspath(path)) for il, t in enumerate(tensors)
        ]
    return BiasSet(tensors=tensors, **{**meta, "k_rot": bool(meta["k_rot"])})


# ----------------------------------------------------------------------------------------------
# Channel order: transformers vs llama.cpp

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
        # (H, D) -> (H, D/2, 2)[h, i, r] -> (H, 2, D/2)[h, r, i] -> index r * D/2 + i
        tensors = [t.reshape(t.shape[0], -1, 2).transpose(1, 2).reshape(t.shape) for t in tensors]
    return dataclasses.replace(bias, tensors=tensors, channel_order=CHANNEL_ORDERS[0])
