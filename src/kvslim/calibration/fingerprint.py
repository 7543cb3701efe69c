"""A model's weights fingerprinted: what bias files and prompt cache files record to recognise the model
they were made for. It knows nothing about loading (:mod:`kvslim.models`) or caches."""

from __future__ import annotations

import hashlib

import torch


def model_fingerprint(model: torch.nn.Module, samples: int = 4096) -> str:
    """A stable fingerprint of a model's weights: ``sha256:<hex>``.

    Covers every tensor of the state dict (persistent buffers included, tied weights under each of
    their names), in sorted name order: its name, its shape, and ``samples`` evenly strided values of
    the flattened tensor (all of them when it is smaller), rounded to bfloat16. Not covered: the
    values between the samples (any fine-tune or re-quantization moves the sampled ones too), the
    config beyond what the shapes imply, the tokenizer, non-persistent buffers (rotary tables).

    Rounding to bfloat16 makes the fingerprint the same for a checkpoint loaded in float32 or in
    bfloat16 (fp32 -> bf16 is one deterministic rounding), so a calibration file made in one is
    recognised in the other; a float16 load generally differs (double rounding). Sampling keeps it
    at milliseconds for SmolLM2-135M, where hashing every value takes ~3.5 s.

    K mean-centering bias files record it (``kv_mean_center.model_sha256``, see
    :mod:`kvslim.calibration.biasfile`) and loading compares it: any change to what is hashed makes every
    existing bias file look calibrated for another model.

    A tensor-parallel model's sharded weights (DTensors) are gathered whole first (``full_tensor()``,
    one tensor at a time), so every rank computes the single-process fingerprint. That gather is a
    collective: every rank must call this, and does so in the same (sorted) order.
    """
    dtensor = _dtensor_type()
    h = hashlib.sha256()
    state = model.state_dict()
    for name in sorted(state):
        tensor = state[name].detach()
        if dtensor is not None and isinstance(tensor, dtensor):
            tensor = tensor.full_tensor()  # a collective: (global shape), the same on every rank
        flat = tensor.reshape(-1)
        if flat.numel() > samples:
            flat = flat[:: flat.numel() // samples][:samples]  # (samples,) evenly strided, a view
        values = flat.to("cpu", torch.bfloat16).contiguous()
        h.update(f"{name}:{tuple(tensor.shape)};".encode())
        h.update(values.view(torch.int16).numpy().tobytes())
    return "sha256:" + h.hexdigest()


def _dtensor_type():
    """``torch.distributed.tensor.DTensor``, or None when this torch has no torch.distributed."""
    if not torch.distributed.is_available():
        return None
    from torch.distributed.tensor import DTensor

    return DTensor
