"""Attention kernels on the encoded KV store: K scores and attention-weighted V sums, no fp copy.

Two functions, one per matmul of attention, over the *encoded* body of a stream (see
:mod:`kvslim.cache.layer`: the sinks and the fp residual are plain tensors the caller handles itself)::

    k_scores(q, codec, enc, offset)   -> (B, H, M, T)   q @ K^T,  K = codec.decode(enc, fp32, offset)
    v_weighted(p, codec, enc, offset) -> (B, H, M, D)   p @ V,    V = codec.decode(enc, fp32, offset)
    k_scores(q, codec, enc, offset, transform)          q @ K'^T, K' = the decoded keys with a
                                                        :class:`KeyTransform` applied per token

``q``: (B, H_kv, M, D) fp32 (the GQA group of each KV head folded into M, softmax scale applied);
``p``: (B, H_kv, M, T) fp32 probabilities. Both need a contiguous last dim only: slices of bigger
tensors are fine. ``enc`` holds views narrowed along dim 2 of the cache's buffers; ``offset`` is how
many tokens of the first per-channel K group were already evicted (0 for per-token formats).

Backends, chosen per call by a registry keyed by (backend, codec family):

- ``torch`` (:mod:`.reference`): decode + matmul, any device, any codec; the semantics.
- ``cpu`` (:mod:`.cpu`): C kernels built on first use, for CPU tensors of the formats they cover and
  query axes up to :data:`.cpu.MAX_M`; they read each code once and never write an fp32 copy.
- ``triton`` (:mod:`.gpu`): Triton programs for CUDA tensors of every family but ``generic``, query
  axes up to :data:`.gpu.MAX_M`; same reading discipline, the V sum split over the tokens. Optional
  (``pip install kvslim[gpu]``); CPU tensors only through Triton's interpreter, when asked for by
  name (``set_backend("triton")`` and ``TRITON_INTERPRET=1``, for the tests).

``set_backend("auto" | "torch" | "cpu" | "triton")`` or ``$KVSLIM_KERNELS`` picks: ``auto`` tries
the backends of :data:`PREFERENCE` in order, ``cpu`` the C kernels then the reference, ``triton``
the Triton programs then the reference, ``torch`` the reference only. A kernel that does not cover a
call (a tensor on another device, long query axis, failed build, Triton missing) passes it to the
next backend, ending at the reference.

Scores with a :class:`KeyTransform` (pre-RoPE keys, whose rotation is applied on read; a Hadamard
basis or a fitted rotation's matrix together with it) go to a backend's ``k_scores_transformed`` when it has
one — the C kernels apply the transform to each decoded tile, in L1 — else to the reference's, which decodes
:data:`.reference.TRANSFORM_TILE` tokens at a time (a bounded fp32 scratch, never a copy of the
history).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..formats import Codec, Encoded
from . import cpu, gpu, gpu_rows, reference  # noqa: F401 - gpu_rows: reached as kernels.gpu_rows

BACKENDS = ("auto", "torch", "cpu", "triton")
#: Order in which "auto" tries backends (the reference last, as it covers everything). Each declines
#: the other's device: triton takes CUDA tensors, cpu host tensors.
PREFERENCE = ["triton", "cpu", "torch"]

KernelFn = Callable[[torch.Tensor, Codec, Encoded, int], torch.Tensor]


@dataclass(frozen=True)
class KeyTransform:
    """What turns a decoded stored key into the key attention scores against, per token, in this order:

    1. ``bias`` (H_kv, D) float32 added (the mean-centering zero point; None: none) — to the tokens whose
       ``centered`` flag (B, H_kv, T, 1) uint8 is set (None: to every token);
    2. ``hadamard`` (a :class:`~kvslim.cache.hadamard.Hadamard`, or a fitted rotation whose ``inverse`` takes the
       key back from the stored basis, :class:`~kvslim.calibration.rotation.FittedRotation`) applied (None: none);
    3. RoPE: channel pair ``(o + i, o + i + R/2)`` of token ``t`` (body index) rotated by the angle whose
       cosine and sine are ``cos[b, t, i]`` / ``sin[b, t, i]``, ``cos``/``sin`` (B or 1, T, R/2) float32,
       ``o = rope_offset`` (None: no rotation).
    """

    bias: torch.Tensor | None = None
    hadamard: object | None = None
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None
    rope_offset: int = 0
    centered: torch.Tensor | None = None


@dataclass(frozen=True)
class Kernel:
    """One backend's pair of kernels for one codec family.

    ``supports(x, codec, enc)`` (x: the query or the probabilities) says whether this kernel takes a
    call; a False passes it on to the next backend.
    """

    k_scores: KernelFn
    v_weighted: KernelFn
    supports: Callable[[torch.Tensor, Codec, Encoded], bool] = lambda x, codec, enc: True
    #: ``(q, codec, enc, offset, transform) -> scores`` with a :class:`KeyTransform`; None: the reference's
    k_scores_transformed: Callable | None = None


#: (backend, family) -> Kernel
REGISTRY: dict[tuple[str, str], Kernel] = {}
#: backend -> () -> (usable, why); checked (and, for cpu, built) lazily on first use.
AVAILABILITY: dict[str, Callable[[], tuple[bool, str]]] = {}


def register(backend: str, family: str, kernel: Kernel, availability=None) -> None:
    """Add (or replace) the kernel of ``backend`` for codecs of ``family``."""
    REGISTRY[(backend, family)] = kernel
    if availability is not None:
        AVAILABILITY[backend] = availability


def codec_family(codec: Codec) -> str:
    """The codec's layout family (``Codec.family``, from its registered format's ``family[role]``):
    affine_k, affine_v, ggml, fp8, cast or generic."""
    return getattr(codec, "family", "generic")


# --------------------------------------------------------------------------- backend choice

_chosen: str | None = None  # set_backend(); None = $KVSLIM_KERNELS or "auto"


def set_backend(name: str | None) -> None:
    """Pick the kernels: "auto", "torch" (the reference), "cpu" or "triton"; None returns to
    $KVSLIM_KERNELS."""
    global _chosen
    if name is not None and name not in BACKENDS:
        raise ValueError(f"kernel backend must be one of {BACKENDS}, got {name!r}")
    _chosen = name


def get_backend() -> str:
    """The requested backend: set_backend's, else $KVSLIM_KERNELS, else "auto"."""
    if _chosen is not None:
        return _chosen
    env = os.environ.get("KVSLIM_KERNELS", "auto").strip().lower() or "auto"
    if env not in BACKENDS:
        raise ValueError(f"$KVSLIM_KERNELS must be one of {BACKENDS}, got {env!r}")
    return env


def _usable(backend: str) -> bool:
    check = AVAILABILITY.get(backend)
    return check is None or check()[0]


def select(x: torch.Tensor, codec: Codec, enc: Encoded) -> tuple[str, Kernel]:
    """(backend, kernel) that serves a call with query/probabilities ``x``."""
    wanted = get_backend()
    order = PREFERENCE if wanted == "auto" else list(dict.fromkeys([wanted, "torch"]))
    family = codec_family(codec)
    for backend in order:
        kernel = REGISTRY.get((backend, family)) or REGISTRY.get((backend, "generic"))
        if kernel is not None and kernel.supports(x, codec, enc) and _usable(backend):
            return backend, kernel
    raise ValueError(f"no kernel for codec {codec.name!r} (family {family}) on {x.device}")


def cpu_serves(x: torch.Tensor, *bodies: Encoded) -> bool:
    """Whether :func:`select` gives calls with ``x`` on these bodies to the C kernels, as far as the backend
    and the devices decide (the format's own support is the caller's :func:`cpu.attend_supported`): for a
    call that fuses several kernel calls (:func:`kvslim.attention._fused_decode`), at a fraction of the cost of
    one ``select`` per body. For CPU tensors "auto" never picks triton (its interpreter is opt-in by name)."""
    return cpu_serves_query(x) and on_cpu(*bodies)


def cpu_serves_query(x: torch.Tensor) -> bool:
    """:func:`cpu_serves`' answer for what does not depend on the bodies (the backend, the query): asked once
    for the rows of a ragged step, whose bodies are then checked with :func:`on_cpu` one by one."""
    return get_backend() in ("auto", "cpu") and x.is_cpu and 0 < x.shape[2] <= cpu.MAX_M and _usable("cpu")


def triton_serves_query(x: torch.Tensor) -> bool:
    """Whether a decode step's attention for queries ``x`` (B, H_kv, M, D) goes to the Triton rows program
    (:mod:`.gpu_rows`): CUDA tensors under "auto" or "triton", CPU tensors only when the interpreter was asked for
    by name (:func:`kvslim.kernels.gpu.cpu_opt_in`), M up to :data:`.gpu.MAX_M`, Triton usable. The bodies are
    the caller's to check (:func:`kvslim.kernels.gpu_rows.attend_supported`)."""
    wanted = get_backend()
    if wanted not in ("auto", "triton") or not 0 < x.shape[2] <= gpu.MAX_M or x.dtype != torch.float32:
        return False
    if not (x.is_cuda or (x.is_cpu and gpu.cpu_opt_in(wanted))):
        return False
    return gpu.installed() and _usable("triton")


def on_cpu(*bodies: Encoded) -> bool:
    """Whether every part of these encoded bodies is a CPU tensor."""
    return all(t.is_cpu for enc in bodies for t in (*enc.token.values(), *enc.group.values()))


def available() -> dict:
    """Which backend is requested, each backend's state and why (builds the C kernels if needed)."""
    info = {"requested": get_backend(), "preference": list(PREFERENCE), "backends": {}}
    for backend in dict.fromkeys([*PREFERENCE, "torch"]):
        check = AVAILABILITY.get(backend)
        ok, why = check() if check else (True, "always available")
        fams = sorted(f for (b, f) in REGISTRY if b == backend)
        info["backends"][backend] = {"available": ok, "reason": why, "families": fams}
    cpu_ok = info["backends"]["cpu"]["available"]
    triton = info["backends"]["triton"]
    if info["requested"] == "torch":
        info["active"] = "torch"
        info["why"] = "requested"
    elif info["requested"] == "triton":
        info["active"] = "triton" if triton["available"] else "torch"
        info["why"] = triton["reason"]
    elif cpu_ok:
        info["active"] = "cpu"
        info["why"] = (
            f"C kernels for CPU tensors of {', '.join(info['backends']['cpu']['families'])} "
            f"with M <= {cpu.MAX_M}; the torch reference otherwise"
        )
    else:
        info["active"] = "torch"
        info["why"] = f"C kernels unavailable: {info['backends']['cpu']['reason']}"
    if info["requested"] == "auto" and triton["available"] and torch.cuda.is_available():
        info["why"] += f"; CUDA tensors: {triton['reason']} (M <= {gpu.MAX_M})"
    return info


# --------------------------------------------------------------------------- the API


def _tokens(enc: Encoded) -> int:
    if not enc.token:
        raise ValueError("encoded body has no token parts")
    return next(iter(enc.token.values())).shape[2]


def _as_input(x: torch.Tensor, what: str, shape_doc: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or x.dim() != 4 or not x.is_floating_point():
        got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{what} must be a floating point tensor {shape_doc}, got {got}")
    if x.dtype != torch.float32:
        x = x.float()
    if x.shape[-1] > 1 and x.stride(-1) != 1:
        x = x.contiguous()
    return x


def _check_heads(x: torch.Tensor, enc: Encoded, what: str) -> None:
    ref = next(iter(enc.token.values()))
    if tuple(x.shape[:2]) != tuple(ref.shape[:2]):
        raise ValueError(
            f"{what} has batch x heads {tuple(x.shape[:2])} but the encoded body has {tuple(ref.shape[:2])}"
        )


def k_scores(
    q: torch.Tensor, codec: Codec, enc: Encoded, offset: int = 0, transform: KeyTransform | None = None
) -> torch.Tensor:
    """Scores of the queries against the encoded keys: (B, H, M, D) -> (B, H, M, T) fp32; with a
    ``transform``, against the decoded keys transformed per token (:class:`KeyTransform`)."""
    q = _as_input(q, "q", "(B, H_kv, M, D)")
    t = _tokens(enc)
    _check_heads(q, enc, "q")
    if t == 0:
        return q.new_zeros((*q.shape[:3], 0))
    _, kernel = select(q, codec, enc)
    if transform is None:
        return kernel.k_scores(q, codec, enc, offset)
    if transform.cos is not None and (
        transform.cos.shape[-2] != t or transform.sin.shape != transform.cos.shape
    ):
        raise ValueError(
            f"the RoPE angles cover {transform.cos.shape[-2]} tokens (sin {tuple(transform.sin.shape)}), "
            f"the encoded body {t}"
        )
    fn = kernel.k_scores_transformed or reference.k_scores_transformed
    return fn(q, codec, enc, offset, transform)


def v_weighted(p: torch.Tensor, codec: Codec, enc: Encoded, offset: int = 0) -> torch.Tensor:
    """Probability-weighted sum of the encoded values: (B, H, M, T) -> (B, H, M, D) fp32."""
    p = _as_input(p, "p", "(B, H_kv, M, T)")
    t = _tokens(enc)
    _check_heads(p, enc, "p")
    if p.shape[-1] != t:
        raise ValueError(f"p has {p.shape[-1]} tokens along its last dim, the encoded body {t}")
    _, kernel = select(p, codec, enc)
    return kernel.v_weighted(p, codec, enc, offset)


# --------------------------------------------------------------------------- registrations

register(
    "torch", "generic", Kernel(reference.k_scores, reference.v_weighted), lambda: (True, "always available")
)


def _cpu_ok(extra=None):
    def supports(x: torch.Tensor, codec: Codec, enc: Encoded) -> bool:
        if not x.is_cpu or x.shape[2] > cpu.MAX_M or x.numel() == 0:
            return False
        if not all(t.is_cpu for t in (*enc.token.values(), *enc.group.values())):
            return False  # raw pointers go to C: every tensor must be in host memory
        return extra is None or extra(codec, enc)

    return supports


register(
    "cpu",
    "affine_k",
    Kernel(
        cpu.k_affine,
        reference.v_weighted,
        _cpu_ok(cpu.affine_k_supported),
        k_scores_transformed=cpu.k_affine_transformed,
    ),
    cpu.status,
)
register("cpu", "affine_v", Kernel(reference.k_scores, cpu.v_affine, _cpu_ok(cpu.affine_v_supported)))
for _family in ("ggml", "fp8", "cast"):
    register(
        "cpu",
        _family,
        Kernel(
            cpu.k_rows, cpu.v_rows, _cpu_ok(cpu.rows_supported), k_scores_transformed=cpu.k_rows_transformed
        ),
    )


def _triton_ok(x: torch.Tensor, codec: Codec, enc: Encoded) -> bool:
    """Every tensor on x's GPU (or, opted in, all on the CPU for the interpreter), M <= gpu.MAX_M."""
    if x.numel() == 0 or x.shape[2] > gpu.MAX_M:
        return False
    tensors = (*enc.token.values(), *enc.group.values())
    if x.is_cuda:
        if not all(t.device == x.device for t in tensors):
            return False
    elif not (x.is_cpu and all(t.is_cpu for t in tensors) and gpu.cpu_opt_in(get_backend())):
        return False
    return gpu.supported(codec, enc)


for _family in ("affine_k", "affine_v", "ggml", "fp8", "cast"):
    register("triton", _family, Kernel(gpu.k_scores, gpu.v_weighted, _triton_ok), gpu.status)

__all__ = [
    "BACKENDS",
    "cpu_serves",
    "Kernel",
    "KeyTransform",
    "available",
    "codec_family",
    "get_backend",
    "k_scores",
    "register",
    "select",
    "set_backend",
    "v_weighted",
]
