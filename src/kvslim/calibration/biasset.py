"""The K mean-centering bias as data: :class:`BiasSet` (per-layer ``(H_kv, D)`` tensors and their provenance),
:class:`KStats`, and the checks of one layer's tensor that every reader shares.

A leaf: it imports nothing from kvslim. The file's bytes are :mod:`kvslim.calibration.biasfile`'s, the checks
against a model and the hand-over to a cache :mod:`kvslim.calibration.meancenter`'s, measuring
:mod:`kvslim.calibration.calibrate`'s, applying one the cache layer's (:mod:`kvslim.cache.layer`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

#: The two K channel orders a bias can be in: transformers' (what kvslim's cache stores) and llama.cpp's
#: (permuted for llama-arch models; :func:`kvslim.calibration.channelorder.to_llama_cpp_order`).
CHANNEL_ORDERS = ("transformers", "llama.cpp")


#: ``kv_mean_center.rotation``: the method the rotation tensors were fitted with (the only one so far).
METHOD = "pca-hadamard"
#: Roles a file holds rotations for, in file order.
ROLES = ("k", "v")


def rotation_name(layer: int, role: str) -> str:
    """The GGUF tensor name of layer ``layer``'s fitted rotation of ``role`` (``k`` or ``v``)."""
    return f"kv_rot.blk.{layer}.{role}"


def tensor_name(layer: int) -> str:
    """The GGUF tensor name of layer ``layer``'s K bias (the fork's naming; also how messages name a layer)."""
    return f"kv_bar.blk.{layer}.k"


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
        tensors unless :func:`~kvslim.calibration.biasfile.read_bias_file` was given the head shape.
    k_rot: the basis: True if K was calibrated after a Hadamard rotation (``rotate='k'``/``'kv'``;
        :mod:`kvslim.cache.hadamard`).
    pre_rope: True if K was calibrated before RoPE (``pre_rope=True``; kvslim only, the fork has no
        such basis).
    model_fingerprint: kvslim's model fingerprint, ``sha256:<64 hex>``
        (:func:`kvslim.calibration.fingerprint.model_fingerprint`), stored as the bare hex digits in
        ``kv_mean_center.model_sha256``; None if unknown (also for a file whose ``model_sha256`` is
        another tool's identity, e.g. the fork's GGUF-file hash).
    cache_type: the K storage format the bias was calibrated for (e.g. ``q4_0``); None if unknown.
    channel_order: ``transformers`` (the K channel order of the transformers model, what kvslim's
        cache stores), ``llama.cpp`` (permuted for llama.cpp, see
        :func:`~kvslim.calibration.channelorder.to_llama_cpp_order`), or None if unknown (a fork-written file:
        llama.cpp's order).
    n_tokens, text_sha256, ctx, n_chunks: the calibration run (tokens used, sha256 of the text's
        UTF-8 bytes, chunk length, number of chunks); None if unknown (e.g. a fork-written file).
    architecture: the GGUF ``general.architecture`` of a file that has one (kvslim writes none; it
        decides the channel order of a file in llama.cpp's order); None otherwise.
    stats: K spread measured during calibration (in memory only, never written).
    rotations: ``{"k": [...], "v": [...]}``, one fitted rotation ``(H_kv, D, D)`` float32 per layer
        (:mod:`kvslim.calibration.rotation`, ``y = R x`` from the file's unrotated basis: post- or pre-RoPE as
        ``pre_rope`` says, never Hadamard-rotated), or None; a file with them is schema version 2.
    rotation: the method they were fitted with (:data:`kvslim.calibration.rotation.METHOD`), None without.
    """

    tensors: list[torch.Tensor]
    k_rot: bool = False
    pre_rope: bool = False
    model_fingerprint: str | None = None
    cache_type: str | None = None
    channel_order: str | None = CHANNEL_ORDERS[0]
    n_tokens: int | None = None
    text_sha256: str | None = None
    ctx: int | None = None
    n_chunks: int | None = None
    architecture: str | None = None
    stats: KStats | None = field(default=None, repr=False)
    rotations: dict[str, list[torch.Tensor]] | None = field(default=None, repr=False)
    rotation: str | None = None

    @property
    def n_layers(self) -> int:
        return len(self.tensors)

    def metadata(self) -> dict:
        """Everything but the tensors, as a plain dict."""
        return {
            "k_rot": self.k_rot,
            "pre_rope": self.pre_rope,
            "model_fingerprint": self.model_fingerprint,
            "cache_type": self.cache_type,
            "channel_order": self.channel_order,
            "n_tokens": self.n_tokens,
            "text_sha256": self.text_sha256,
            "ctx": self.ctx,
            "n_chunks": self.n_chunks,
            "architecture": self.architecture,
            "rotation": self.rotation,
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
