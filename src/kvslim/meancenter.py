"""K mean-centering: the per-layer bias set, and handing it to a cache validated against the model.

A symmetric block quantizer (q4_0, q5_0, q8_0: ``x ~= scale * q``, no zero point) spends dynamic
range on a channel's constant offset. Subtracting a fixed per-(kv-head, channel) mean ``k_bar``
from every cached key before quantization gives that range back, and is exactly softmax-invariant:
``q . (k_i - k_bar) = q . k_i - q . k_bar`` shifts every logit of a query row by the same constant.
The technique and the file layout come from PrismML's llama.cpp fork (PR #51, ``--kv-mean-center``,
``tools/kv-mean-center``); see docs/mean-center.md.

This module holds a bias (:class:`BiasSet`) and checks one against a model's shapes
(:func:`load_mean_center`, what :class:`~kvslim.SlimCache` calls). It does not measure a bias
(:mod:`kvslim.calibrate`), know the file's bytes (:mod:`kvslim.biasfile`) or apply a bias (the cache
layer subtracts it, :mod:`kvslim.layer`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from .biasfile import CHANNEL_ORDERS, fingerprint_hex, read_layers, tensor_name


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
        tensors unless :func:`~kvslim.biasfile.read_bias_file` was given the head shape.
    k_rot: the basis: True if K was calibrated after a Hadamard rotation (no kvslim option
        rotates K yet, so kvslim always writes False).
    model_fingerprint: kvslim's model fingerprint, ``sha256:<64 hex>``
        (:func:`kvslim.models.model_fingerprint`), stored as the bare hex digits in
        ``kv_mean_center.model_sha256``; None if unknown (also for a file whose ``model_sha256`` is
        another tool's identity, e.g. the fork's GGUF-file hash).
    cache_type: the K storage format the bias was calibrated for (e.g. ``q4_0``); None if unknown.
    channel_order: ``transformers`` (the K channel order of the transformers model, what kvslim's
        cache stores), ``llama.cpp`` (permuted for llama.cpp, see
        :func:`~kvslim.biasfile.to_llama_cpp_order`), or None if unknown (a fork-written file:
        llama.cpp's order).
    n_tokens, text_sha256, ctx, n_chunks: the calibration run (tokens used, sha256 of the text's
        UTF-8 bytes, chunk length, number of chunks); None if unknown (e.g. a fork-written file).
    stats: K spread measured during calibration (in memory only, never written).
    """

    tensors: list[torch.Tensor]
    k_rot: bool = False
    model_fingerprint: str | None = None
    cache_type: str | None = None
    channel_order: str | None = CHANNEL_ORDERS[0]
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
# Loading for a cache


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
    check_positive_int("n_layers", n_layers)
    heads = _per_layer("n_kv_heads", n_kv_heads, n_layers)
    dims = _per_layer("head_dim", head_dim, n_layers)
    meta: dict = {}
    if isinstance(value, (str, os.PathLike)):
        where = os.fspath(value)
        layers, meta = read_layers(value)
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
            f"(or convert it with kvslim.biasfile.from_llama_cpp_order)"
        )
    file_fp = meta.get("model_fingerprint")
    if file_fp and model_fingerprint and fingerprint_hex(file_fp) != fingerprint_hex(model_fingerprint):
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
    return [check_layer(layers[il], il, heads[il], dims[il], where=where).to(dtype) for il in range(n_layers)]


def check_layer(t, il: int, n_kv_heads: int, head_dim: int, *, where: str) -> torch.Tensor:
    """Validate layer ``il``'s bias (a tensor or numpy array, ``(H_kv, D)`` or ``(H_kv * D,)``) and
    return it as a float32 ``(H_kv, D)`` tensor. ``where`` names its source in error messages."""
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


def check_positive_int(name: str, value) -> None:
    """Raise ValueError unless ``value`` is an int >= 1 (bools refused)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


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
        check_positive_int(name, v)
    return values
