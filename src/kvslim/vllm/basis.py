"""Hadamard rotation of kvslim pages inside vLLM's backend: which roles are rotated, and the four places it applies.

kvslim's own cache stores its quantized K and V rotated by an orthonormal Hadamard matrix (QuaRot, llama.cpp since
PR #21038; :mod:`kvslim.cache.hadamard`): a channel's outlier is spread over its block before a scale is chosen.
Attention does not change, because ``H`` is orthonormal and its own inverse: ``(H q) . (H k) = q . k`` and
``sum_i p_i (H v_i) = H (sum_i p_i v_i)``. Inside vLLM the backend keeps the whole stored history in the rotated
basis, and rotates only what crosses its border:

- the K and V a step writes (:meth:`PageBasis.keys`, :meth:`PageBasis.values`), before they are encoded into
  their pages or copied into a staging slot (:mod:`.staging`), so a page's codes, a staged page and the step's own
  raw K/V are all in one basis;
- the queries, by K's matrix, before the kernel scores them, and the attention output, by V's matrix, after it
  sums the values: both inside the kernel's call (:func:`attend`, the kernel's ``rotate``: a Hadamard transform of
  each head's row, rather than two more torch calls a layer).

The matrix is kvslim's own (:class:`~kvslim.cache.hadamard.Hadamard`: Sylvester, block the largest power of two
dividing head_dim), so a rotated page holds byte for byte the codes kvslim's own cache encodes for the same K/V
with the same rotation (tests/test_vllm_basis.py). Rotated values are float32; the encoders take them as they are.

K mean-centering (``mean_center=FILE``, a bias file of ``kvslim calibrate`` for keys after RoPE, as vLLM hands
them): each layer's bias is subtracted from every key the backend stores or reads raw, after the rotation (the
file records the basis it was calibrated in; ``rotate=auto`` rotates K as the file records it, kvslim's own rule).
Attention needs no correction: every key a query scores is centered alike, so its scores all move by ``q . bias``,
which the softmax ignores. (kvslim's own cache centers a per-token format's token only where that lowers its
error, and adds ``q . bias`` back to the centered ones; a page has no room for that choice: every key is
centered.) The model fingerprint a file records is not checked here (vLLM's weights are not transformers'
module tree); the layers, heads, head_dim, K format, basis and channel order are.

``rotate``: ``none``; ``k``, ``v``, ``kv``: those roles (each must be stored encoded: a rotation of fp16/bf16/fp32
values only adds rounding, and is refused as kvslim's own cache refuses it); ``auto``: every encoded role whose
head_dim allows a rotation, as kvslim's own cache resolves it (:data:`AUTO`); ``fitted`` is refused (its matrices
come from a calibration file, not read here).

This module imports nothing of vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..cache.hadamard import Hadamard
from ..cache.levers import bias_basis
from ..config import CacheConfig
from . import attend as paged
from .pages import PageLayout

#: Whether ``rotate=auto`` rotates the encoded roles in pages, as it does in kvslim's own cache (docs/vllm.md,
#: "Hadamard rotation": measured through vLLM on the embedded model).
AUTO = True


@dataclass(frozen=True)
class ModelShape:
    """What a bias file is checked against: the model's layers, total KV heads and ``config.model_type``."""

    n_layers: int
    n_kv_heads: int
    model_type: str | None = None


@dataclass(frozen=True)
class PageBasis:
    """The rotation of each role (None: stored as given), and the K bias of each layer (None: no centering)."""

    k: Hadamard | None = None
    v: Hadamard | None = None
    #: per model layer, the K mean-centering bias (H_kv, D) float32 in K's stored basis (:func:`load_biases`)
    k_bias: tuple[torch.Tensor, ...] | None = None

    @classmethod
    def of(cls, config: CacheConfig, layout: PageLayout, model: ModelShape | None = None) -> PageBasis:
        """The rotations ``config.rotate`` asks for on ``layout``'s parts, and the K biases of ``config.mean_center``
        (checked against ``model``, which a bias file needs); ValueError in one line (prefixed ``kvslim:``) for a
        rotation or a bias that cannot be honoured."""
        rotate = config.rotate
        recorded = None  # the bias file's (k_rot, pre_rope)
        if config.mean_center is not None:
            recorded = bias_basis(config.mean_center)
            if recorded is None:  # unreadable: loading it below says why
                recorded = (False, False)
            if recorded[1]:
                raise ValueError(
                    f"kvslim: mean_center={config.mean_center!r} was calibrated for keys stored before RoPE "
                    f"(k_pre_rope); vLLM hands the backend its keys after RoPE: calibrate without --kv-pre-rope"
                )
        if rotate == "fitted":  # its matrices are in the mean_center file, beside the bias the plugin reads
            raise ValueError(
                "kvslim: rotate='fitted' is not supported in vLLM (its matrices come from a calibration file the "
                "plugin does not read); use rotate=auto, k, v or kv (a Hadamard rotation)"
            )
        encoded = {role: getattr(layout, role).family != "cast" for role in "kv"}
        if rotate == "auto":
            roles = [r for r in "kv" if AUTO and encoded[r]]
            if recorded is not None and not recorded[0]:  # K as the bias file records it (kvslim's own rule)
                roles = [r for r in roles if r != "k"]
        else:
            roles = [r for r in "kv" if r in rotate.replace("none", "")]
            plain = [r for r in roles if not encoded[r]]
            if plain:
                names = " and ".join(f"{r.upper()} ({getattr(layout, r).name})" for r in plain)
                raise ValueError(
                    f"kvslim: rotate={rotate!r}: {names} is stored as plain values in pages, which a rotation would "
                    f"only round: only encoded (quantized) tensors are stored rotated"
                )
        rotations = {}
        for role in roles:
            try:
                rotations[role] = Hadamard.for_head_dim(layout.head_dim)
            except ValueError as e:
                if rotate == "auto":
                    continue  # a head_dim without a Hadamard block: auto leaves it as it is, as kvslim's own cache does
                raise ValueError(f"kvslim: rotate={rotate!r}: {' '.join(str(e).split())}") from None
        biases = None
        if config.mean_center is not None:
            if model is None:
                raise ValueError("kvslim: mean_center needs the model's shape to check the bias file against")
            biases = load_biases(config.mean_center, model, layout, k_rot="k" in rotations)
        return cls(rotations.get("k"), rotations.get("v"), biases)

    @property
    def name(self) -> str:
        """``none``, ``k``, ``v`` or ``kv``: what is rotated."""
        return "".join(r for r in "kv" if getattr(self, r) is not None) or "none"

    def keys(self, x: torch.Tensor, layer: int | None = None) -> torch.Tensor:
        """Keys (N, H_kv, D) of model layer ``layer`` as the pages store them: rotated to float32 by K's matrix,
        minus the layer's bias (float32), or as given."""
        y = x if self.k is None else self.k.apply(x)
        if self.k_bias is None:
            return y
        if layer is None or not 0 <= layer < len(self.k_bias):
            raise ValueError(
                f"kvslim: no K bias for layer {layer!r} (the bias file has {len(self.k_bias)} layers)"
            )
        bias = self.k_bias[layer]
        if tuple(bias.shape) != tuple(y.shape[1:]):
            raise ValueError(
                f"kvslim: layer {layer}'s K bias is {tuple(bias.shape)} but its keys are {tuple(y.shape[1:])} per "
                f"token (a tensor-parallel rank holds a share of the KV heads: mean_center is not supported there)"
            )
        return y.float() - bias

    def stored(
        self, key: torch.Tensor, value: torch.Tensor, layer: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, float | None]:
        """``(keys(key, layer), values(value), m)``: the step's K and V as the pages store them, in one C call where it
        can take them (:func:`kvslim.vllm.attend.rotate_kv`: the same bits, no K bias), and m the largest ``|value|``
        of both (NaN if any; None where they were rotated in torch)."""
        if self.k is None and self.v is None and self.k_bias is None:
            return key, value, None
        if self.k_bias is None:
            got = paged.rotate_kv(key, value, self.k, self.v)
            if got is not None:
                keys, values, km, vm = got
                return keys, values, km if km != km or km > vm else vm
        return self.keys(key, layer), self.values(value), None

    def values(self, x: torch.Tensor) -> torch.Tensor:
        """Values (N, H_kv, D) as the pages store them: rotated to float32 by V's matrix, or as given."""
        return x if self.v is None else self.v.apply(x)


def load_biases(path, model: ModelShape, layout: PageLayout, k_rot: bool) -> tuple[torch.Tensor, ...]:
    """Every layer's K bias of the file at ``path`` (H_kv, D) float32, checked as kvslim's own cache checks it
    (:func:`kvslim.calibration.meancenter.load_mean_center`: layers, shapes, values, the K format, the basis
    ``k_rot``, the channel order), except the model fingerprint: vLLM's weights are not transformers' module tree,
    so the fingerprint kvslim records cannot be computed here (docs/vllm.md). Read once per process and path."""
    key = (str(path), model, layout.k.name, layout.head_dim, k_rot)
    got = _BIASES.get(key)
    if got is None:
        from ..calibration.meancenter import load_mean_center

        try:
            got = tuple(
                load_mean_center(
                    path,
                    n_layers=model.n_layers,
                    n_kv_heads=model.n_kv_heads,
                    head_dim=layout.head_dim,
                    model_type=model.model_type,
                    k_format=layout.k.name,
                    k_rot=k_rot,
                    pre_rope=False,
                )
            )
        except (OSError, ValueError) as e:
            raise ValueError(f"kvslim: mean_center={str(path)!r}: {' '.join(str(e).split())}") from None
        _BIASES[key] = got
    return got


_BIASES: dict = {}


def attend(
    basis: PageBasis,
    layout: PageLayout,
    kv_cache: torch.Tensor,
    query: torch.Tensor,
    out: torch.Tensor,
    rows: paged.Rows,
    scale: float,
    window: int = 0,
    causal: bool = True,
    keys: torch.Tensor | None = None,
    values: torch.Tensor | None = None,
    staged: paged.Staged | None = None,
    sink: int = 0,
) -> None:
    """:func:`kvslim.vllm.attend.attend` on pages stored in ``basis``: the queries rotated into K's basis and the
    output back from V's inside the kernel's call (its ``rotate``), ``out`` in the model's basis. ``keys``,
    ``values``: the step's raw K/V already in the basis (:meth:`PageBasis.keys`, :meth:`PageBasis.values`), as the
    staging slots hold them."""
    rotate = (basis.k.block if basis.k is not None else 0, basis.v.block if basis.v is not None else 0)
    paged.attend(layout, kv_cache, query, out, rows, scale, window, causal, keys, values, staged, sink, rotate)
