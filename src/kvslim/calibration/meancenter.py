"""K mean-centering: the per-layer bias set, and handing it to a cache validated against the model.

A symmetric block quantizer (q4_0, q5_0, q8_0: ``x ~= scale * q``, no zero point) spends dynamic
range on a channel's constant offset. Subtracting a fixed per-(kv-head, channel) mean ``k_bar``
from every cached key before quantization gives that range back, and is exactly softmax-invariant:
``q . (k_i - k_bar) = q . k_i - q . k_bar`` shifts every logit of a query row by the same constant.
The technique and the file layout come from PrismML's llama.cpp fork (PR #51, ``--kv-mean-center``,
``tools/kv-mean-center``); see docs/mean-center.md.

This module checks a bias against a model's shapes and hands it to a cache in the cache's channel
order (:func:`load_mean_center`, what :class:`~kvslim.SlimCache` calls). It does not define the bias
data (:class:`~kvslim.calibration.biasset.BiasSet`, re-exported here), measure a bias (:mod:`kvslim.calibration.calibrate`),
know the file's bytes or convert channel orders (:mod:`kvslim.calibration.biasfile`) or apply a bias (the cache
layer subtracts it, :mod:`kvslim.cache.layer`).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .biasfile import fingerprint_hex, read_layers
from .biasset import (
    CHANNEL_ORDERS,
    BiasSet,
    KStats,  # noqa: F401 - defined in kvslim.calibration.biasset, still importable from here
    check_layer,
    check_positive_int,
    tensor_name,
)
from .channelorder import (
    LLAMA_CPP_PERMUTES_K,
    LLAMA_CPP_PERMUTES_K_ARCH,
    file_channel_order,
    from_llama_cpp_order,
)

#: The CLI's name for ``allow_other_model=True``, quoted in messages.
ANY_MODEL_FLAG = "--kv-mean-center-any-model"


# ----------------------------------------------------------------------------------------------
# Loading for a cache


def load_mean_center(
    value,
    *,
    n_layers: int,
    n_kv_heads: int | Sequence[int],
    head_dim: int | Sequence[int],
    model_fingerprint: str | None = None,
    allow_other_model: bool = False,
    model_type: str | None = None,
    k_rot: bool = False,
    pre_rope: bool = False,
    k_format: str | None = None,
    key_dtype: torch.dtype | None = None,
    dtype: torch.dtype = torch.float32,
) -> list[torch.Tensor]:
    """Per-layer K biases for a cache, validated against the model, in the cache's channel order.

    value: a bias file path (str / PathLike), a :class:`BiasSet`, or a list of per-layer tensors
        (each ``(H_kv, D)`` or 1-D ``(H_kv * D,)``, channel fastest, in transformers' order).
    n_layers, n_kv_heads, head_dim: the model's (``n_kv_heads`` / ``head_dim`` may be per-layer lists).
    model_fingerprint: the model's (:func:`kvslim.calibration.fingerprint.model_fingerprint`); when the file records
        kvslim's fingerprint too and they differ, the file was calibrated for another model (a base
        vs an instruct checkpoint of one family has the same shapes): ValueError, unless
        ``allow_other_model=True``, which warns and uses it (centering stays exact; only its benefit
        is in doubt).
    model_type: the model's ``config.model_type``. A file in llama.cpp's channel order (the fork's
        files, which record no order, and kvslim's ``--llama-cpp-order`` files) is converted to
        transformers' order when llama.cpp permutes K for the architecture (the file's
        ``general.architecture`` when it has one, else ``model_type``); without either, such a file
        is refused rather than read in the wrong order.
    k_rot, pre_rope: the basis the cache stores K in (Hadamard-rotated; before RoPE); a file recording
        another basis is refused (as the fork does for k_rot; a file without the pre-RoPE key is post-RoPE).
        A rotated file in llama.cpp's channel order is converted in the rotated basis
        (:func:`~kvslim.calibration.channelorder.permute_rotated`, the block rule of :mod:`kvslim.cache.hadamard`).
    k_format, key_dtype: the K storage format and the dtype of the model's keys, when known. A bias
        larger than the format can store (:func:`bias_limit`; a centered key ``k - bias`` would
        overflow every block) or than ``key_dtype`` holds is refused here, not mid-generation.
    Returns ``n_layers`` tensors ``(H_kv, D)`` in ``dtype`` on the CPU.
    Raises ValueError naming the tensor and what was expected vs found: a missing or extra layer, a
    wrong element count, shape or dtype, non-finite or impossibly large values, a basis, channel
    order or fingerprint mismatch.
    """
    check_positive_int("n_layers", n_layers)
    heads = _per_layer("n_kv_heads", n_kv_heads, n_layers)
    dims = _per_layer("head_dim", head_dim, n_layers)
    meta: dict = {}
    if isinstance(value, (str, os.PathLike)):
        where = os.fspath(value)
        layers, meta = read_layers(value)
        order = file_channel_order(meta)
    elif isinstance(value, BiasSet):
        where = "the given BiasSet"
        layers, meta = dict(enumerate(value.tensors)), value.metadata()
        order = file_channel_order(meta)  # None: read from a fork file, llama.cpp's order
    elif isinstance(value, (list, tuple)):
        where = "the given tensors"
        layers = dict(enumerate(value))
        order = CHANNEL_ORDERS[0]
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
            f"{basis[bool(k_rot)]}; recalibrate with matching settings (kvslim calibrate "
            f"--kv-rotate {'k' if k_rot else 'none'})"
        )
    file_pre = bool(meta.get("pre_rope"))
    if file_pre != bool(pre_rope):
        basis = {True: "pre-RoPE (k_pre_rope=true)", False: "post-RoPE (no k_pre_rope)"}
        raise ValueError(
            f"{where} was calibrated in the {basis[file_pre]} K basis, but this cache stores K "
            f"{basis[bool(pre_rope)]}; recalibrate with matching settings (kvslim calibrate"
            f"{' --kv-pre-rope' if pre_rope else ''})"
        )
    file_fp = meta.get("model_fingerprint")
    if file_fp and model_fingerprint and fingerprint_hex(file_fp) != fingerprint_hex(model_fingerprint):
        _other_model(
            f"{where} was calibrated for another model: the file records model fingerprint "
            f"{_short(file_fp, model_fingerprint)}, this model's is {_short(model_fingerprint, file_fp)}",
            allow_other_model,
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
    tensors = [check_layer(layers[il], il, heads[il], dims[il], where=where) for il in range(n_layers)]
    if order == CHANNEL_ORDERS[1]:
        arch = meta.get("architecture")
        known = arch in LLAMA_CPP_PERMUTES_K_ARCH and model_type in LLAMA_CPP_PERMUTES_K
        if known and LLAMA_CPP_PERMUTES_K_ARCH[arch] != LLAMA_CPP_PERMUTES_K[model_type]:
            _other_model(
                f"{where} comes from a GGUF {arch!r} model (general.architecture), this model is "
                f"a {model_type!r}, whose K channels llama.cpp orders differently",
                allow_other_model,
            )
        if not arch and model_type is None:
            raise ValueError(
                f"{where} holds K channels in llama.cpp's order ("
                + (
                    "kv_mean_center.channel_order = llama.cpp"
                    if meta.get("channel_order")
                    else "a file without kv_mean_center.channel_order is the llama.cpp fork's"
                )
                + "), which differs from transformers' for some architectures (llama); pass the "
                "model's model_type (SlimCache does, given config=) so it can be converted"
            )
        # the one conversion (kvslim.calibration.biasfile): a rotated bias, the mean of H P k, back to kvslim's H k
        in_file = BiasSet(tensors, k_rot=bool(file_k_rot), channel_order=order, architecture=arch or None)
        tensors = from_llama_cpp_order(in_file, model_type).tensors
    limit = bias_limit(k_format, key_dtype)
    for il, t in enumerate(tensors):
        biggest = float(t.abs().max())
        if biggest > limit.value:
            raise ValueError(
                f"{tensor_name(il)} ({where}): a value of magnitude {biggest:.4g}, but {limit.why} "
                f"hold at most {limit.value:.6g}; a key centered by it would overflow (is this a K "
                f"mean at all?)"
            )
    return [t.to(dtype) for t in tensors]


@dataclass(frozen=True)
class BiasLimit:
    value: float
    why: str


def bias_limit(k_format: str | None = None, key_dtype: torch.dtype | None = None) -> BiasLimit:
    """The largest |bias| that can be right: a centered key ``k - bias`` must fit the K storage
    format (:func:`kvslim.formats.ggml.ggml_max_abs`: its fp16 block scale times the code range;
    for an unknown format, the most permissive mean-centering format) and the model's key dtype."""
    from ..config import MEAN_CENTER_FORMATS
    from ..formats.ggml import GGML_KINDS, ggml_max_abs

    if k_format is not None and k_format in GGML_KINDS:
        best = BiasLimit(ggml_max_abs(k_format), f"{k_format} blocks")
    else:  # unknown (or not a block format): the most permissive block format that allows centering
        blocks = [name for name in MEAN_CENTER_FORMATS if name in GGML_KINDS]
        widest = max((ggml_max_abs(name) for name in blocks), default=float(torch.finfo(torch.float32).max))
        best = BiasLimit(widest, f"the mean-centering formats' blocks ({', '.join(blocks)})")
    if key_dtype is not None and key_dtype.is_floating_point:
        dtype_max = float(torch.finfo(key_dtype).max)
        if dtype_max < best.value:
            best = BiasLimit(dtype_max, f"{str(key_dtype).replace('torch.', '')} keys")
    return best


def _short(fingerprint: str, other: str | None = None) -> str:
    """16 hex digits of ``fingerprint``, more where ``other`` shares them (up to 4 past the first difference)."""
    digits, theirs = fingerprint_hex(fingerprint), fingerprint_hex(other) if other else ""
    same = next((i for i, (a, b) in enumerate(zip(digits, theirs)) if a != b), min(len(digits), len(theirs)))
    n = max(16, same + 4) if theirs else 16
    return "sha256:" + digits[:n] + ("..." if n < len(digits) else "")


def _other_model(message: str, allow: bool) -> None:
    if not allow:
        raise ValueError(
            f"{message}; recalibrate for this model (kvslim calibrate), or pass allow_other_model=True "
            f"(CLI: {ANY_MODEL_FLAG}) to use it anyway"
        )
    warnings.warn(
        f"{message}; using it anyway (allow_other_model): attention stays exact, but the bias may not "
        "center this model's keys",
        UserWarning,
        stacklevel=3,
    )


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
