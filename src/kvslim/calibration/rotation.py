"""A fitted rotation of the stored K and V: per layer and KV head, an orthogonal matrix fitted to a text.

What is fitted, per (layer, KV head, role K or V), from the calibration text's keys / values ``x`` (D channels):

1. ``E``: the eigenvectors of the channel statistics, descending eigenvalues ``lambda`` — for K the covariance
   (K is quantized per channel over a token group, with a zero point: a channel's mean costs nothing, its
   spread does), for V the second moment ``E[x x^T]`` (V is quantized per token across channels: a token's
   offset shares its range);
2. the eigen-directions dealt to the Hadamard blocks of :mod:`kvslim.cache.hadamard` round-robin in that
   order (one block for a power-of-two head_dim), so every block gets a like share of the variance;
3. ``R = H P E^T``: rotate into the eigenbasis, then mix every block with the Sylvester Hadamard matrix ``H``.

After step 1 the channels are decorrelated but the variance is concentrated in the first few (a principal
axis quantized with the range of a tail axis wastes codes — eigenvectors alone make low-bit quantization
worse); the Hadamard mix of step 3 gives every channel of a block the same variance, ``diag(H L H) =
mean(L)`` exactly for ``L`` diagonal, which a random Hadamard rotation (QuaRot) only gives in expectation.
This is the recipe of rotations fitted to K/V statistics offline — OSCAR's per-layer rotation fitted to the
K/V covariance (issue 32), SpinQuant's learned rotations (Liu et al., 2024) learn theirs by gradient descent
on the quantization loss, KVQuant (Hooper et al., 2024) quantizes pre-RoPE keys per channel — in its
closed-form version: no learning, no clipping thresholds (not fitted here; see docs/quality.md, "Fitted
rotation"), one ``D x D`` matrix per (layer, KV head, role).

Attention is unchanged (``R`` orthogonal): the query is rotated once, ``(R q) . (R k) = q . k``, and a V sum
rotated back once, ``R^T sum_i p_i R v_i``. A pre-RoPE key is rotated back (``R^T``) per decoded key before
its RoPE (:class:`kvslim.kernels.KeyTransform`): RoPE turns each token's channel pairs by that token's angles and
a dense ``R`` does not commute with that, so no single rotated query serves every token; the C transform kernels
do it in the tile (``D^2`` multiply-adds a key, the Hadamard's ``D log D``), the torch reference with a matmul
(:func:`kvslim.kernels.reference.apply_transform`). A fitted basis is fused in the C rows call
(:mod:`kvslim.fused`): post-RoPE, the queries taken to it once (``R q``); pre-RoPE, each key taken back in the
piece's key transform; the V sum taken back once (``R^T``). Matrices are float32; the fit is float64.

This module fits, holds and loads the rotations. The file's bytes are :mod:`.biasfile`'s; observing the
keys is :mod:`.calibrate`'s; the cache applies a rotation where it applies a Hadamard basis
(:class:`kvslim.cache.basis.BodyBasis`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from .biasset import METHOD, ROLES, rotation_name  # noqa: E402,F401 - the file facts live beside tensor_name

# ----------------------------------------------------------------------------------------------
# Applying


@dataclass(frozen=True, eq=False)
class FittedRotation:
    """One layer's rotation of one role: ``matrix`` (H_kv, D, D) float32, ``y = R x`` per KV head.

    The same interface as :class:`kvslim.cache.hadamard.Hadamard` (``apply`` into the stored basis, ``inverse``
    back, ``for_layer``), on 4-D tensors whose dim 1 is the KV head. ``block`` is 0: no fast block transform;
    the C rows call (fused decode, post-RoPE) and the C transform kernels (pre-RoPE keys) take ``matrix`` itself."""

    matrix: torch.Tensor
    block = 0
    _on: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def dim(self) -> int:
        return int(self.matrix.shape[-1])

    def for_layer(self, layer: int) -> FittedRotation:
        return self

    def _m(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 4 or x.shape[1] != self.matrix.shape[0] or x.shape[-1] != self.dim:
            raise ValueError(
                f"a fitted rotation of {self.matrix.shape[0]} KV heads x {self.dim} channels got a tensor of "
                f"shape {tuple(x.shape)}, expected (B, {self.matrix.shape[0]}, T, {self.dim})"
            )
        m = self._on.get(x.device)
        if m is None:
            m = self._on[x.device] = self.matrix.to(device=x.device, dtype=torch.float32).contiguous()
        return m  # (H, D, D)

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """``R x`` along the last dim of ``x`` (B, H, T, D) -> float32 (B, H, T, D)."""
        return torch.matmul(x.float(), self._m(x).transpose(-1, -2))  # (B,H,T,D) @ (H,D,D): x R^T

    def inverse(self, y: torch.Tensor) -> torch.Tensor:
        """``R^T y`` (B, H, T, D) -> float32 (B, H, T, D): back to the appended basis."""
        return torch.matmul(y.float(), self._m(y))

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """Every tensor this rotation holds: ``matrix`` and the copy made on each other device it served (on the
        CPU ``_m`` hands back ``matrix`` itself)."""
        return (self.matrix, *self._on.values())

    def nbytes(self) -> int:
        """Bytes of :meth:`tensors`, each distinct tensor once."""
        return held_nbytes(self.tensors())


@dataclass(frozen=True)
class LayerRotations:
    """The fitted rotations of one role for every layer of a model; ``for_layer(i)`` is layer i's."""

    layers: tuple[FittedRotation, ...]

    def for_layer(self, layer: int) -> FittedRotation:
        return self.layers[layer]

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(t for r in self.layers for t in r.tensors())

    def nbytes(self) -> int:
        return held_nbytes(self.tensors())


def held_nbytes(tensors) -> int:
    """Bytes of ``tensors``, a tensor met twice (the same device, address and size: one object, or views of one
    memory) counted once."""
    seen = {(str(t.device), t.data_ptr(), t.numel() * t.element_size()) for t in tensors}
    return sum(n for _, _, n in seen)


# ----------------------------------------------------------------------------------------------
# Fitting


class MomentSums:
    """float64 running sums per (layer, role): sum ``(H, D)``, sum of outer products ``(H, D, D)``, count."""

    def __init__(self):
        self.sum: dict[tuple[int, str], torch.Tensor] = {}
        self.outer: dict[tuple[int, str], torch.Tensor] = {}
        self.count: dict[tuple[int, str], int] = {}

    def add(self, layer: int, role: str, x: torch.Tensor) -> None:
        """x: ``(B, H, T, D)``, unpadded."""
        x = x.detach().to(torch.float64)
        s = x.sum(dim=(0, 2))  # (H, D)
        flat = x.transpose(0, 1).reshape(x.shape[1], -1, x.shape[3])  # (H, B*T, D)
        o = flat.transpose(1, 2) @ flat  # (H, D, D)
        key = (layer, role)
        if key in self.sum:
            self.sum[key] += s
            self.outer[key] += o
            self.count[key] += x.shape[0] * x.shape[2]
        else:
            self.sum[key], self.outer[key], self.count[key] = s, o, x.shape[0] * x.shape[2]

    def statistic(self, layer: int, role: str) -> torch.Tensor:
        """K: the channel covariance; V: the second moment (module docstring). ``(H, D, D)`` float64."""
        n = self.count[(layer, role)]
        m2 = self.outer[(layer, role)] / n
        if role == "k":
            mean = self.sum[(layer, role)] / n  # (H, D)
            m2 = m2 - mean[:, :, None] * mean[:, None, :]
        return m2


def fit_rotation(stat: torch.Tensor, block: int) -> torch.Tensor:
    """The rotation of the module docstring for channel statistics ``stat`` (H, D, D) (symmetric PSD) and
    Hadamard blocks of ``block`` channels: ``R`` (H, D, D) float64, orthogonal.

    Deterministic: eigenvectors signed so that their largest-magnitude entry is positive."""
    from ..cache.hadamard import sylvester

    stat = stat.to(torch.float64)
    h, d, _ = stat.shape
    if d % block:
        raise ValueError(f"a Hadamard block of {block} does not tile head_dim {d}")
    stat = (stat + stat.transpose(-1, -2)) / 2
    lam, vec = torch.linalg.eigh(stat)  # ascending; vec[:, :, j] is eigenvector j
    order = torch.argsort(lam, dim=-1, descending=True)  # (H, D)
    vec = torch.gather(vec, 2, order[:, None, :].expand(h, d, d))
    idx = vec.abs().argmax(dim=1, keepdim=True)  # (H, 1, D)
    vec = vec * torch.gather(vec, 1, idx).sign()
    nb = d // block
    # eigen-direction j (descending) goes to block j % nb, slot j // nb: blocks share the variance alike
    deal = torch.tensor([(j % nb) * block + j // nb for j in range(d)])
    et = torch.empty_like(vec)
    et[:, deal, :] = vec.transpose(1, 2)  # row deal[j] of P E^T is eigenvector j
    hmat = torch.block_diag(*[sylvester(block)] * nb)  # (D, D) float64
    return hmat @ et


def fit_from_sums(sums: MomentSums, n_layers: int, block_of: dict[str, int]) -> dict[str, list[torch.Tensor]]:
    """Per role, one float32 ``(H, D, D)`` rotation per layer from the observed moments; ``block_of[role]``
    is the role's Hadamard block (:func:`kvslim.cache.hadamard.block_size`)."""
    out: dict[str, list[torch.Tensor]] = {}
    for role in ROLES:
        missing = [il for il in range(n_layers) if not sums.count.get((il, role))]
        if missing:
            raise ValueError(f"layers {missing} received no {role.upper()} during calibration")
        out[role] = [
            fit_rotation(sums.statistic(il, role), block_of[role]).to(torch.float32) for il in range(n_layers)
        ]
    return out


# ----------------------------------------------------------------------------------------------
# Loading for a cache


def check_rotation(t, il: int, role: str, n_kv_heads: int, head_dim: int, *, where: str) -> torch.Tensor:
    """Validate layer ``il``'s rotation of ``role``: ``(H_kv, D, D)`` float, finite, orthogonal to fp32
    tolerance; returns it float32. ValueError (one line) otherwise."""
    name = rotation_name(il, role)
    t = torch.as_tensor(t)
    if tuple(t.shape) != (n_kv_heads, head_dim, head_dim) or not t.dtype.is_floating_point:
        raise ValueError(
            f"{name} ({where}): shape {tuple(t.shape)} dtype {t.dtype}, expected float ({n_kv_heads}, "
            f"{head_dim}, {head_dim}) (n_kv_heads, head_dim, head_dim)"
        )
    t = t.detach().to(torch.float32).contiguous()  # rows contiguous: the C kernels and _m use it as it is
    if not torch.isfinite(t).all():
        raise ValueError(f"{name} ({where}): non-finite values")
    err = float(
        (t.double() @ t.double().transpose(-1, -2) - torch.eye(head_dim, dtype=torch.float64)).abs().max()
    )
    if err > 1e-4:
        raise ValueError(f"{name} ({where}): not orthogonal (|R R^T - I| up to {err:.3g}, expected < 1e-4)")
    return t


def load_rotations(
    value, *, n_layers: int, n_kv_heads: int, head_dim: int, v_head_dim: int | None = None
) -> tuple[dict[str, LayerRotations], dict]:
    """The fitted rotations a calibration file (a path or a :class:`~.biasset.BiasSet`) holds, checked against
    the model's shapes: ``({"k": LayerRotations, "v": LayerRotations}, the file's metadata)``.

    ValueError with one line when ``value`` is None or holds no rotation (``rotate='fitted'`` needs one,
    written by ``kvslim calibrate --fit-rotation``)."""
    from .biasset import BiasSet

    hint = "write one with kvslim calibrate --fit-rotation, or use rotate='auto' / 'kv'"
    if value is None:
        raise ValueError(
            f"rotate='fitted' needs a calibration file with a fitted rotation (mean_center=FILE); {hint}"
        )
    if isinstance(value, (str, os.PathLike)):
        from .biasfile import read_file

        where = os.fspath(value)
        _, meta, rotations = read_file(value)
    elif isinstance(value, BiasSet):
        where, meta = "the given BiasSet", value.metadata()
        rotations = {r: dict(enumerate(ts)) for r, ts in (value.rotations or {}).items()}
    else:
        raise ValueError(
            f"rotate='fitted' needs mean_center to be a calibration file path or a BiasSet, got {type(value).__name__}"
        )
    if not rotations:
        raise ValueError(f"{where} holds no fitted rotation (no kv_rot.blk.<il>.k/v tensors); {hint}")
    dims = {"k": head_dim, "v": v_head_dim or head_dim}
    out = {}
    for role in ROLES:
        layers = rotations.get(role, {})
        for il in range(n_layers):
            if il not in layers:
                raise ValueError(
                    f"{rotation_name(il, role)} missing; {where} holds {len(layers)} {role.upper()} rotations, "
                    f"the model has {n_layers} layers"
                )
        extra = sorted(il for il in layers if il >= n_layers)
        if extra:
            raise ValueError(
                f"{rotation_name(extra[0], role)} present in {where}, but the model has {n_layers} layers"
            )
        out[role] = LayerRotations(
            tuple(
                FittedRotation(check_rotation(layers[il], il, role, n_kv_heads, dims[role], where=where))
                for il in range(n_layers)
            )
        )
    return out, meta


def bias_to_fitted(bias: torch.Tensor, rotation: FittedRotation, k_rot: bool) -> torch.Tensor:
    """A K mean ``(H, D)`` recorded in the file's basis (Hadamard-rotated when ``k_rot``) -> the same mean in the
    fitted basis: ``R x`` of the unrotated mean (the mean is linear)."""
    from ..cache.hadamard import Hadamard

    x = bias.float()[None, :, None, :]  # (1, H, 1, D)
    if k_rot:
        x = Hadamard.for_head_dim(x.shape[-1]).apply(x)  # H is its own inverse
    return rotation.apply(x)[0, :, 0, :]
