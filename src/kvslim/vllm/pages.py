"""vLLM's paged KV cache in kvslim's formats: the byte layout of a page, and the writes through a slot mapping.

vLLM (0.32, CPU) hands each attention layer one uint8 tensor ``kv_cache: (num_blocks, H_kv, T, C)`` (its
``LBHNC`` layout: head-major block interiors), ``T`` = 32 tokens per (block, KV head) — a page — and ``C`` =
:attr:`PageLayout.row_bytes` bytes per token, the backend's ``customize_spec`` (``state_content_bytes``).
A token's row holds its K, then its V, each in the registered format of its role:

============  ===============================================  =========================================
family        bytes of one role in a token row                 same bytes as
============  ===============================================  =========================================
``cast``      the values in the format's dtype (``none``: the  the values
              model's own dtype; fp16; bf16), ``D * size``
``ggml``      ``D / 32`` blocks of the format (q8_0: 34 bytes, :func:`kvslim.formats.quantize_ggml` on
              q4_0: 18, q4_1: 20, q5_0: 22, q5_1: 24)          (1, 1, 1, D): kvslim's own and llama.cpp's
``affine``    codes ``D * bits / 8`` (packed as                :func:`~kvslim.formats.affine.quantize_per_token`
              :mod:`kvslim.formats.affine`), then scale and    with one group per head: kvslim's V codec
              zero as fp16 (4 bytes); int4, int3, int2         (``v_group=None``)
``sym``       int8 only: an fp16 scale, then ``D`` int8 codes  q8_0's block layout, one block per head
              (``D + 2``; value = code x scale, codes
              -127..127, scale = max |x| / 127)
``fp8``       ``D`` float8 e4m3fn codes, then the token's      kvslim's fp8 cache (:mod:`kvslim.formats.floats`:
              fp32 scale (``D + 4``; value = code x scale,     the same codes and scale)
              scale = max(max |x| / 448, 1e-12))
============  ===============================================  =========================================

8-bit affine pages are symmetric (a page-only layout, ``sym``): one fp16 scale per token and head and no zero,
so an int8 token row is ``D + 2`` bytes per role instead of ``D + 4`` (66 at D = 64: 1.94x the tokens of bf16
pages in the same space, where the asymmetric layout, like q8_0's two blocks, gave 1.88x). kvslim's own int8
cache is asymmetric (KIVI); the GGML formats keep llama.cpp's bytes.

Affine K is stored *per token* here (kvslim's own cache stores KIVI's per-channel K, scales shared by a group
of 32 tokens, which would encode a page from its staged copy (:mod:`.staging`) when it fills: not built yet), so
the plugin allows only int8 and int4 for K (:mod:`.spec`).

Writes (:func:`write`) encode only the tokens of this step and scatter their rows into their slots: a token
is encoded once, when it is written, and a page is never re-encoded.

This module knows nothing of vLLM's classes: tensors in, tensors out.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..formats import dequantize_ggml, get_format, quantize_ggml
from ..formats.affine import dequantize_per_token, packed_dim, quantize_per_token

#: Tokens per page: vLLM's kernel block size for this backend, one GGML/KIVI group.
PAGE_TOKENS = 32
#: Bytes of an affine role's scale + zero (fp16 each).
AFFINE_META = 4
#: Bytes of a symmetric 8-bit role's scale (fp16).
SYM_META = 2
#: The dtype of the affine scale and zero in a page.
SCALE_DTYPE = torch.float16
#: Bytes of an fp8 role's scale (fp32).
FP8_META = 4
#: Cast formats by name (``none`` takes the model's dtype).
CAST_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class Part:
    """One role's bytes in a token row: format ``name`` (its ``family``), ``nbytes`` from ``offset``.

    dtype: a cast part's value dtype (None otherwise); bits: an affine part's code width (None otherwise)."""

    name: str
    family: str
    offset: int
    nbytes: int
    dtype: torch.dtype | None = None
    bits: int | None = None


def make_part(name: str, role: str, head_dim: int, model_dtype: torch.dtype, offset: int) -> Part:
    """The :class:`Part` of format ``name`` for ``role`` ("k"/"v") at ``offset`` of the row."""
    fmt = get_format(name)
    codec = fmt.codec(role)
    codec.check_head_dim(head_dim)
    family = fmt.family[role]
    if family == "cast":
        dtype = CAST_DTYPES.get(name, model_dtype)
        return Part(name, "cast", offset, head_dim * dtype.itemsize, dtype=dtype)
    if family == "ggml":
        size, nbytes = fmt.block
        return Part(name, "ggml", offset, head_dim // size * nbytes)
    if family == "fp8":
        return Part(name, "fp8", offset, head_dim + FP8_META, bits=8)
    if family in ("affine_k", "affine_v") and fmt.bits == 8:
        return Part(name, "sym", offset, head_dim + SYM_META, bits=8)
    if family in ("affine_k", "affine_v"):
        return Part(name, "affine", offset, packed_dim(fmt.bits, head_dim) + AFFINE_META, bits=fmt.bits)
    raise ValueError(f"kvslim: format {name!r} (family {family}) has no vLLM page layout")


@dataclass(frozen=True)
class PageLayout:
    """The byte layout of a token row of a page: K's :class:`Part`, then V's; ``head_dim`` D."""

    k: Part
    v: Part
    head_dim: int

    @classmethod
    def of(cls, k_format: str, v_format: str, head_dim: int, model_dtype: torch.dtype) -> PageLayout:
        k = make_part(k_format, "k", head_dim, model_dtype, 0)
        v = make_part(v_format, "v", head_dim, model_dtype, k.nbytes)
        return cls(k, v, head_dim)

    @property
    def row_bytes(self) -> int:
        """Bytes of one token of one KV head (K and V): vLLM's ``state_content_bytes``."""
        return self.k.nbytes + self.v.nbytes

    def encode(self, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """key, value: (N, H, D) floating point -> rows uint8 (N, H, row_bytes)."""
        return torch.cat([encode_part(self.k, key), encode_part(self.v, value)], dim=-1)

    def decode(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """rows uint8 (..., row_bytes) -> (K, V) fp32 (..., D)."""
        return decode_part(self.k, rows, self.head_dim), decode_part(self.v, rows, self.head_dim)


def encode_part(part: Part, x: torch.Tensor) -> torch.Tensor:
    """x: (N, H, D) floating point -> uint8 (N, H, part.nbytes)."""
    if part.family == "cast":
        return x.to(part.dtype).contiguous().view(torch.uint8)
    if part.family == "ggml":
        return quantize_ggml(x, part.name)
    if part.family == "sym":
        scale = (x.float().abs().amax(-1, keepdim=True) / 127).to(SCALE_DTYPE)  # (N, H, 1)
        s = scale.float()
        q = (
            torch.where(s > 0, x.float() / torch.where(s > 0, s, 1), 0)
            .round()
            .clamp(-127, 127)
            .to(torch.int8)
        )
        return torch.cat([scale.view(torch.uint8), q.view(torch.uint8)], dim=-1)
    if part.family == "fp8":  # kvslim's fp8 codec: codes (N, H, D) float8_e4m3fn, scale (N, H, 1) float32
        enc = get_format("fp8").codec("k").encode(x)
        return torch.cat([enc.token["codes"].view(torch.uint8), enc.token["scale"].view(torch.uint8)], dim=-1)
    codes, scale, zero = quantize_per_token(x, part.bits, None, SCALE_DTYPE)  # (N,H,D*b/8), (N,H,1) x2
    return torch.cat([codes, scale.view(torch.uint8), zero.view(torch.uint8)], dim=-1)


def decode_part(part: Part, rows: torch.Tensor, head_dim: int) -> torch.Tensor:
    """rows: uint8 (..., row_bytes) -> this part's values fp32 (..., D)."""
    b = rows[..., part.offset : part.offset + part.nbytes]
    if part.family == "cast":
        return b.contiguous().view(part.dtype).float()
    if part.family == "ggml":
        return dequantize_ggml(b.contiguous(), part.name)
    if part.family == "sym":
        scale = b[..., :SYM_META].contiguous().view(SCALE_DTYPE).float()  # (..., 1)
        return b[..., SYM_META:].contiguous().view(torch.int8).float() * scale
    if part.family == "fp8":
        n = part.nbytes - FP8_META
        scale = b[..., n:].contiguous().view(torch.float32)  # (..., 1)
        return b[..., :n].contiguous().view(torch.float8_e4m3fn).float() * scale
    n = part.nbytes - AFFINE_META
    scale = b[..., n : n + 2].contiguous().view(SCALE_DTYPE)  # (..., 1)
    zero = b[..., n + 2 : n + 4].contiguous().view(SCALE_DTYPE)
    return dequantize_per_token(b[..., :n].contiguous(), scale, zero, part.bits, None, torch.float32)


def write(
    layout: PageLayout,
    kv_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Encode the step's tokens and store each row in its slot.

    kv_cache: uint8 (num_blocks, H, T, row_bytes) (any strides); key, value: (N', H, D) with N' >= N, the
    first N tokens written; slot_mapping: (N,) integer, slot ``s`` = page ``s // T``, token ``s % T``;
    negative slots (vLLM's padding) are skipped."""
    n = slot_mapping.shape[0]
    want = (kv_cache.shape[1], layout.head_dim) if kv_cache.dim() == 4 else None
    for name, x in (("key", key), ("value", value)):
        if want is None or x.dim() != 3 or tuple(x.shape[1:]) != want or x.shape[0] < n:
            raise ValueError(
                f"kvslim pages: {name} has shape {tuple(x.shape)}, expected (>= {n}, {want[0] if want else 'H_kv'}, "
                f"{layout.head_dim}): the KV heads and head size of pages of shape {tuple(kv_cache.shape)}"
            )
    if n == 0:
        return
    slots = slot_mapping.long()
    keep = slots >= 0
    if not bool(keep.all()):
        slots, key, value = slots[keep], key[:n][keep], value[:n][keep]
    else:
        key, value = key[:n], value[:n]
    t = kv_cache.shape[2]
    kv_cache[slots // t, :, slots % t] = layout.encode(key, value)  # rows (N, H, C) into (N, H, C)


def gather(layout: PageLayout, kv_cache: torch.Tensor, blocks: torch.Tensor, length: int):
    """The first ``length`` tokens stored in pages ``blocks`` (a row of a block table), decoded:
    (K, V) fp32 (H, length, D)."""
    t = kv_cache.shape[2]
    n = -(-length // t)
    pages = kv_cache[blocks[:n].long()]  # (n, H, T, C)
    h = pages.shape[1]
    rows = pages.transpose(0, 1).reshape(h, n * t, pages.shape[-1])[:, :length]  # (H, n*T, C) -> (H, L, C)
    return layout.decode(rows)


def raw_rows(x: torch.Tensor) -> torch.Tensor:
    """x (N, H, D) as the kernel reads raw K/V: fp32, heads D apart, values contiguous (any token stride)."""
    x = x.float()
    h, d = x.shape[1:]
    if x.stride(2) == 1 and x.stride(1) == d and x.stride(0) >= h * d:
        return x
    # a fresh tensor, not contiguous(): a one-token view such as (1, H, D) with strides (D, D, 1) is contiguous to
    # torch (a dimension of size 1 has any stride) and would come back with a token stride the kernel refuses
    return torch.empty(x.shape, dtype=torch.float32, device=x.device).copy_(x)
