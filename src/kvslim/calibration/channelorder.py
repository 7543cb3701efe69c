"""llama.cpp's K channel order, and the conversions between it and transformers' order.

For llama-arch models llama.cpp's GGUF converter permutes the q/k rows (interleaved RoPE pairs ``(2i,
2i+1)`` instead of transformers' rotate-half pairs ``(i, i + D/2)``), so a K bias measured in one order is
only portable to the other after :func:`to_llama_cpp_order` / :func:`from_llama_cpp_order`; NEOX-RoPE
architectures keep the order. Which architectures permute is a table (:data:`LLAMA_CPP_PERMUTES_K` by
transformers' ``model_type``, :data:`LLAMA_CPP_PERMUTES_K_ARCH` by GGUF ``general.architecture``). A bias in
the Hadamard-rotated basis is converted through the unrotated one (:func:`permute_rotated`). The fork's
files carry no order key and are in llama.cpp's order (:func:`file_channel_order`).

This module knows channel orders only: not the file's bytes (:mod:`.biasfile`), nor how a bias is checked
against a model or applied (:mod:`.meancenter`, the cache).
"""

from __future__ import annotations

import dataclasses

import torch

from .biasset import CHANNEL_ORDERS, BiasSet, tensor_name


def file_channel_order(meta: dict) -> str:
    """The channel order of a file's tensors: its ``kv_mean_center.channel_order`` when it has one
    (kvslim's files), else ``llama.cpp`` -- the fork's convention: its tool averages the K tensor
    llama.cpp writes into its cache (``k_cache_in``), which is in llama.cpp's channel order."""
    return meta.get("channel_order") or CHANNEL_ORDERS[1]


#: model_type -> whether llama.cpp's GGUF converter permutes k_proj rows for it. llama.cpp runs these
#: archs with interleaved ("normal") RoPE, pairs (2i, 2i+1), so convert_hf_to_gguf.py permutes the
#: q/k rows of transformers' rotate-half layout, pairs (i, i + D/2); NEOX-RoPE archs keep the order.
LLAMA_CPP_PERMUTES_K = {
    "llama": True, "mistral": True, "mixtral": True,
    "qwen2": False, "qwen3": False, "qwen2_moe": False, "qwen3_moe": False, "phi3": False,
    "gemma": False, "gemma2": False, "gemma3_text": False, "stablelm": False,
}  # fmt: skip


#: GGUF ``general.architecture`` -> the same fact, for files that name the architecture they came
#: from (llama.cpp converts Llama, Mistral and Mixtral checkpoints to arch ``llama``).
LLAMA_CPP_PERMUTES_K_ARCH = {
    "llama": True,
    "qwen2": False, "qwen3": False, "qwen2moe": False, "qwen3moe": False, "phi3": False,
    "gemma": False, "gemma2": False, "gemma3": False, "stablelm": False,
}  # fmt: skip


def llama_cpp_permutes(model_type: str | None = None, architecture: str | None = None) -> bool:
    """Whether llama.cpp's K channel order differs from transformers' for a model: decided by the
    GGUF ``architecture`` when given (a file's ``general.architecture``), else by transformers'
    ``model_type``. ValueError for an unknown one, or when neither is given."""
    if architecture:
        if architecture not in LLAMA_CPP_PERMUTES_K_ARCH:
            raise ValueError(
                f"unknown whether llama.cpp permutes the K channels of GGUF architecture {architecture!r}; "
                f"known: {', '.join(sorted(LLAMA_CPP_PERMUTES_K_ARCH))}"
            )
        return LLAMA_CPP_PERMUTES_K_ARCH[architecture]
    if model_type is None:
        raise ValueError("the model's architecture (model_type) is needed to tell llama.cpp's channel order")
    return permutes(model_type)


def permutes(model_type: str) -> bool:
    """Whether llama.cpp's converter permutes the K channels of transformers' ``model_type``; ValueError for
    one this table does not know."""
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


def permute_to_llama_cpp(t: torch.Tensor) -> torch.Tensor:
    """One layer ``(H, D)`` in transformers' order -> llama.cpp's order for a permuting arch."""
    # (H, D) -> (H, 2, D/2)[h, r, i] -> (H, D/2, 2)[h, i, r] -> index 2i + r
    return t.reshape(t.shape[0], 2, -1).transpose(1, 2).reshape(t.shape)


def permute_from_llama_cpp(t: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`permute_to_llama_cpp`."""
    # (H, D) -> (H, D/2, 2)[h, i, r] -> (H, 2, D/2)[h, r, i] -> index r * D/2 + i
    return t.reshape(t.shape[0], -1, 2).transpose(1, 2).reshape(t.shape)


def permute_rotated(t: torch.Tensor, to_llama_cpp: bool) -> torch.Tensor:
    """One layer ``(H, D)`` of a bias in the Hadamard-rotated basis (``k_rot``), converted between the two
    channel orders of a permuting arch: llama.cpp rotates its *permuted* keys, ``H P k``, kvslim rotates
    transformers' ``H k``; the mean is linear, so ``b_llama = H P H b_kvslim`` and back with ``P^T``
    (``H`` symmetric and its own inverse; the block rule of :mod:`kvslim.cache.hadamard`, llama.cpp's for K)."""
    from ..cache.hadamard import Hadamard

    h = Hadamard.for_head_dim(int(t.shape[1]))
    perm = permute_to_llama_cpp if to_llama_cpp else permute_from_llama_cpp
    return h.apply(perm(h.apply(t.float())))


def to_llama_cpp_order(bias: BiasSet, model_type: str) -> BiasSet:
    """The same biases with each head's channels in llama.cpp's order for ``model_type``.

    For llama-arch models (Llama, Mistral, SmolLM2) channel ``2i + r`` of llama.cpp's K is channel
    ``r * D/2 + i`` of transformers' K (the converter's q/k permutation, which transformers' GGUF
    loader undoes); other known archs keep the order. Tensors must be ``(H_kv, D)``.
    """
    if bias.channel_order != CHANNEL_ORDERS[0]:
        raise ValueError(f"expected a bias in {CHANNEL_ORDERS[0]!r} order, got {bias.channel_order!r}")
    if bias.pre_rope:
        raise ValueError(
            "a bias of pre-RoPE keys (k_pre_rope) has no llama.cpp counterpart: llama.cpp caches K after RoPE"
        )
    tensors = _two_d(bias.tensors)
    if permutes(model_type):
        tensors = [permute_rotated(t, True) if bias.k_rot else permute_to_llama_cpp(t) for t in tensors]
    return dataclasses.replace(bias, tensors=tensors, channel_order=CHANNEL_ORDERS[1])


def from_llama_cpp_order(bias: BiasSet, model_type: str | None = None) -> BiasSet:
    """Inverse of :func:`to_llama_cpp_order` (also for a fork-written file, whose order is llama.cpp's).

    Whether the order differs is decided by the bias's ``architecture`` (the file's
    ``general.architecture``) when it has one, else by ``model_type``.
    """
    if bias.channel_order not in (None, CHANNEL_ORDERS[1]):
        raise ValueError(f"expected a bias in {CHANNEL_ORDERS[1]!r} order, got {bias.channel_order!r}")
    tensors = bias.tensors
    if llama_cpp_permutes(model_type, bias.architecture):
        # a rotated bias is the mean of H P k: back to kvslim's H k through the unrotated basis
        tensors = [
            permute_rotated(t, False) if bias.k_rot else permute_from_llama_cpp(t) for t in _two_d(tensors)
        ]
    return dataclasses.replace(bias, tensors=tensors, channel_order=CHANNEL_ORDERS[0])
