"""The low-bit levers a cache resolves from a model: its RoPE (read from the model's own rotary module), the
Hadamard rotation per tensor and pre-RoPE storage, ``auto`` resolved (docs/quality.md, "Low-bit levers").

What this module knows: how to find a transformers model's rotary embedding and whether kvslim can move its
keys exactly; which levers a :class:`~kvslim.config.CacheConfig` and a bias file ask for. It knows nothing
about storage or transformers' Cache API (:mod:`kvslim.cache.build` calls it once per cache).
"""

from __future__ import annotations

import os
import warnings

import torch

from ..config import CacheConfig
from ..shapes import ModelShapes, is_mla, text_config
from .hadamard import Hadamard
from .rotary import Rotary, rotate_half_reference

#: RoPE variants whose frequencies do not depend on the positions fed (a key can be moved exactly).
STATIC_ROPE = ("default", "linear", "llama3", "yarn")


def model_rotary(config) -> tuple[Rotary | None, str]:
    """The model's RoPE as a :class:`~kvslim.cache.rotary.Rotary`, read from its own rotary module, or
    ``(None, why)`` when kvslim cannot move its keys exactly."""
    emb, why = rotary_embedding(config)
    if emb is None:
        return None, why
    rope_type = getattr(emb, "rope_type", "default")
    if not isinstance(rope_type, str) or rope_type not in STATIC_ROPE:
        return None, f"rope_type {rope_type!r} (frequencies that change with the positions)"
    return Rotary(emb.inv_freq.detach().to(torch.float32).cpu()), ""


def rotary_embedding(config):
    """``(the model's own rotary module built from its config, "")`` when its RoPE is the rotate-half kind
    kvslim moves, else ``(None, why)``."""
    import importlib

    text = text_config(config)
    if is_mla(text):
        return None, "MLA caches its compressed latent (the rotary key sits in the value slot)"
    module_name = type(text).__module__.replace(".configuration_", ".modeling_")
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        return None, f"no modeling module {module_name}"
    classes = [getattr(module, n) for n in dir(module) if n.endswith("RotaryEmbedding")]
    rotate_half = getattr(module, "rotate_half", None)
    if len(classes) != 1 or rotate_half is None:
        return None, f"{module_name} has no single rotary embedding with rotate_half"
    probe = torch.arange(8.0)
    if not torch.equal(rotate_half(probe), rotate_half_reference(probe)):
        return None, "its RoPE pairs channels differently (interleaved), which kvslim does not move"
    try:
        emb = classes[0](config=text)
    except Exception as e:  # noqa: BLE001 - any failure means: cannot read its frequencies
        return None, f"{classes[0].__name__} could not be built from the config ({e})"
    return emb, ""


def resolve_levers(cfg: CacheConfig, config, shapes: ModelShapes | None, codecs: dict, mean_center):
    """The Hadamard rotation per tensor and the pre-RoPE rope source a cache uses, ``auto`` resolved.

    Explicit values are honoured or refused with the reason. ``rotate='auto'``: every quantized (not fp16/bf16) tensor whose
    head_dim allows a rotation, K as a bias file records it (``k_rot``). ``pre_rope='auto'``: as a bias
    file records it (``k_pre_rope``); without one, for 2-bit K (int2) when the model's RoPE allows it —
    measured (docs/quality.md, "Low-bit levers"): -44% KLD for int2 on top of rotation, -12% for int4,
    +14% (worse) for q4_0 without a bias; it costs a rotation of every stored key per step in the score
    kernel. Nothing is automatic without ``config`` or for MLA latents.

    ``rotate='fitted'``: every encoded (lossy) K and V by the fitted rotations of the ``mean_center`` file
    (:class:`kvslim.calibration.rotation.LayerRotations`, one matrix per layer and KV head); ValueError with one
    line when the file holds none."""
    basis = bias_basis(mean_center) if mean_center is not None else None
    plain = shapes is None or is_mla(text_config(config))
    hadamard: dict[str, Hadamard | None] = {"k": None, "v": None}
    if cfg.rotate == "fitted":
        hadamard = fitted_rotations(codecs, shapes, mean_center, config)
    for role in ("k", "v") if cfg.rotate != "fitted" else ():
        if cfg.rotate == "auto":
            if plain or not codecs[role].lossy or codecs[role].family == "cast":
                continue  # fp16/bf16 storage: a rotation only adds rounding (and can overflow fp16)
            if role == "k" and basis is not None and not basis[0]:
                continue
            dim = shapes.k_head_dim if role == "k" else shapes.v_head_dim
            try:
                hadamard[role] = Hadamard.for_head_dim(dim)
            except ValueError:
                if role == "k" and basis is not None:
                    raise  # the bias file asks for it
            continue
        if role not in cfg.rotate.replace("none", ""):
            continue
        if shapes is None:
            raise ValueError(f"rotate={cfg.rotate!r} needs config=model.config (the Hadamard size is the head_dim's)")
        dim = shapes.k_head_dim if role == "k" else shapes.v_head_dim
        try:
            hadamard[role] = Hadamard.for_head_dim(dim)
        except ValueError as e:
            raise ValueError(f"rotate={cfg.rotate!r}: {role}: {e}") from None
    pre = cfg.pre_rope
    if pre == "auto":
        if basis is not None:
            pre = basis[1]
        elif plain or codecs["k"].bits is None or codecs["k"].bits > 2:
            pre = False
        else:
            try:
                return hadamard, rope_source(config)
            except ValueError:
                return hadamard, None
    if not pre:
        return hadamard, None
    if config is None:
        raise ValueError("pre_rope=True needs config=model.config (it un-rotates keys with the model's RoPE)")
    return hadamard, rope_source(config)


def fitted_rotations(codecs: dict, shapes: ModelShapes | None, mean_center, config) -> dict:
    """``{"k", "v"}`` -> the fitted rotations (:class:`kvslim.calibration.rotation.LayerRotations`) of the encoded
    (lossy) roles, None for the others; ValueError (one line) without a model or a file holding them."""
    if shapes is None or is_mla(text_config(config)):
        raise ValueError("rotate='fitted' needs config=model.config of a model whose K/V are per-head tensors (not MLA)")
    from ..calibration.rotation import load_rotations

    rotations, _ = load_rotations(
        mean_center,
        n_layers=shapes.n_layers,
        n_kv_heads=shapes.n_kv_heads,
        head_dim=shapes.k_head_dim,
        v_head_dim=shapes.v_head_dim,
    )
    return {role: rotations[role] if codecs[role].lossy else None for role in ("k", "v")}


def bias_basis(mean_center) -> tuple[bool, bool] | None:
    """``(k_rot, pre_rope)`` a bias records (a file's keys, a BiasSet's fields; plain tensors: unrotated,
    post-RoPE), or None when it cannot be read here (loading it says why)."""
    from ..calibration.meancenter import BiasSet

    if isinstance(mean_center, BiasSet):
        return bool(mean_center.k_rot), bool(mean_center.pre_rope)
    if isinstance(mean_center, (str, os.PathLike)):
        from ..calibration.biasfile import read_layers

        try:
            _, meta = read_layers(mean_center)
        except (OSError, ValueError):
            return None
        return bool(meta.get("k_rot")), bool(meta.get("pre_rope"))
    return False, False


#: RoPE variants pre-RoPE storage un-rotates and rotates again on read: the static ones, and dynamic NTK
#: (its frequencies are recomputed per forward, as the model does).
PRE_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


class RopeSource:
    """The model's RoPE for each forward, for pre-RoPE storage: fixed frequencies, or dynamic NTK's, which
    the model recomputes from the longest position it is fed (transformers' ``dynamic_rope_update``). For
    those a private instance of the model's own rotary module is fed the same longest positions, so its
    update rule (growth, and the reset below the original length) is the model's, not a copy of it.

    Each key is un-rotated with the frequencies of the forward that wrote it and rotated on read with those
    of the forward that reads it. With static frequencies that is exactly the plain cache. With dynamic NTK
    past ``max_position_embeddings`` the frequencies change from forward to forward: a plain cache keeps
    every key at the frequencies it was written with, pre-RoPE storage presents every key at the current
    ones (as the model without a cache would) — a different result, said once by a warning."""

    def __init__(self, rotary: Rotary, emb=None):
        self.rotary = rotary
        self._original = rotary.inv_freq
        self._emb = emb  # None: static frequencies
        self._warned = False

    @property
    def dynamic(self) -> bool:
        return self._emb is not None

    def at(self, max_position: int) -> Rotary:
        """The Rotary of a forward whose longest position id is ``max_position``."""
        if self._emb is None:
            return self.rotary
        with torch.no_grad():
            self._emb(torch.zeros(1), torch.tensor([[int(max_position)]]))  # runs the model's frequency update
        inv = self._emb.inv_freq.detach().to(torch.float32).cpu()
        if not torch.equal(inv, self.rotary.inv_freq):
            self.rotary = Rotary(inv, self.rotary.offset)
            if not self._warned and not torch.equal(inv, self._original):
                self._warned = True
                warnings.warn(
                    f"pre_rope with dynamic NTK RoPE past the model's original length (position {max_position}): "
                    f"every stored key is rotated with this forward's scaled frequencies, where a plain cache keeps "
                    f"each key at the frequencies it was written with; use pre_rope=False to reproduce the plain "
                    f"cache (docs/quality.md)",
                    UserWarning,
                    stacklevel=4,
                )
        return self.rotary


def rope_source(config) -> RopeSource:
    """The model's RoPE for pre-RoPE storage; ValueError naming why kvslim cannot un-rotate its keys."""
    emb, why = rotary_embedding(config)
    if emb is None:
        raise ValueError(f"pre_rope=True needs the model's RoPE, and {why}; use pre_rope=False")
    rope_type = getattr(emb, "rope_type", "default")
    if not isinstance(rope_type, str) or rope_type not in PRE_ROPE_TYPES:
        raise ValueError(
            f"pre_rope=True supports RoPE types {', '.join(PRE_ROPE_TYPES)}; this model's is {rope_type!r} "
            f"(use pre_rope=False)"
        )
    rotary = Rotary(emb.inv_freq.detach().to(torch.float32).cpu())
    return RopeSource(rotary, emb if rope_type == "dynamic" else None)
