"""What the kernel tests share (tests/test_kernels.py: the C kernels; tests/test_triton.py: the Triton ones):
encoded bodies handed out as views the way the cache hands them out, queries and probabilities as views,
the (format, role, group) cases and the tolerance every kernel is held to against the torch reference.

Tolerance: |out - ref| <= :data:`REL` * sum_d |q_d| |K_td| (and sum_t p_t |V_td| for V), about 84 fp32
ulps of the magnitude of the sum: both sides round each product and sum in a different order.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from kvslim.formats import Encoded, format_names, get_format, make_codec

#: the affine (KIVI) formats: per-channel K with token groups, per-token V with channel groups
AFFINE = tuple(n for n in format_names() if get_format(n).family["k"] == "affine_k")
#: of the score scale sum_d |q_d| |K_td| (and sum_t p_t |V_td|)
REL = 1e-5


def data(b, h, t, d, gen, dtype=torch.float32) -> torch.Tensor:
    """Keys/values (B, H, T, D) with per-channel means (what affine zeros and K mean-centering are about)."""
    mean = torch.randn(1, h, 1, d, generator=gen) * 3
    return (torch.randn(b, h, t, d, generator=gen) * 2 + mean).to(dtype)


def encoded_view(codec, b, h, t, offset, gen, d=64, dtype=torch.float32) -> Encoded:
    """t encoded tokens starting ``offset`` tokens into their first group, as views: one extra head,
    a whole group before and one after (strides of a bigger buffer on dims 0..2, as a TimeBuffer's)."""
    g = codec.token_group
    n = -(-(offset + t) // g)  # groups the tokens touch
    enc = codec.encode(data(b, h + 1, (n + 2) * g, d, gen, dtype))  # (B, H+1, (1 + n + 1) * G, D)
    start = g + offset
    return Encoded(
        token={k: v[:, 1:, start : start + t] for k, v in enc.token.items()},
        group={k: v[:, 1:, 1 : 1 + n] for k, v in enc.group.items()},
    )


def queries(b, h, m, gen, d=64) -> torch.Tensor:
    """q (B, H, M, D) as a view: rows of a bigger tensor (dims 0..2 strides not contiguous)."""
    return (torch.randn(b, h, m + 2, d, generator=gen) * d**-0.5)[:, :, 1 : 1 + m]


def probs(b, h, m, t, gen) -> torch.Tensor:
    """p (B, H, M, T): the body's slice of a softmax over more positions (sinks before, residual after)."""
    return torch.softmax(torch.randn(b, h, m, t + 6, generator=gen) * 3, dim=-1)[..., 4 : 4 + t]


def assert_scaled_close(out, ref, scale, what):
    """out == ref (both float32, same shape) to :data:`REL` of ``scale`` (the sum of magnitudes), element-wise."""
    assert out.shape == ref.shape and out.dtype == torch.float32, (what, out.shape, ref.shape, out.dtype)
    err = (out - ref).abs()
    bad = err > REL * scale + 1e-30
    if bad.any():
        rel = (err / scale.clamp_min(1e-30)).max().item()
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {err.numel()} beyond {REL} (max relative {rel:.3g})"
        )


def cases(k_groups=(8,), v_groups=(None, 16, 32)) -> list:
    """pytest params (name, role, group) of every format and role: K token groups ``k_groups`` for per-channel
    affine K, V channel groups ``v_groups`` for per-token affine V (None: the whole head), one case otherwise."""
    out = []
    for name in format_names():
        for role in ("k", "v"):
            groups = (k_groups if role == "k" else v_groups) if name in AFFINE else (None,)
            out += [
                pytest.param(name, role, g, id=f"{name}-{role}" + (f"-g{g}" if g else "")) for g in groups
            ]
    return out


def case_codec(name, role, group):
    """The codec of a :func:`cases` case."""
    if name in AFFINE and role == "k":
        return make_codec(name, role, group_size=group)
    return make_codec(name, role, v_group_size=group)


@contextlib.contextmanager
def interpreted(program, backend: str | None = None):
    """A Triton test module's set-up: ``TRITON_INTERPRET=1`` (Triton reads it when a program is decorated, so the
    programs built under it are interpreted copies) and one torch thread. ``program()`` must come back as Triton's
    interpreted function; ``backend``: kvslim's kernel backend within (the default again after)."""
    from kvslim import kernels

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("TRITON_INTERPRET", "1")
            from triton.runtime.interpreter import InterpretedFunction

            assert isinstance(program(), InterpretedFunction)
            if backend is not None:
                kernels.set_backend(backend)
            yield
    finally:
        kernels.set_backend(None)
        torch.set_num_threads(threads)
