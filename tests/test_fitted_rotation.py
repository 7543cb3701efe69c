"""The fitted rotation (issue 32 item 2): fitted per layer and KV head by ``kvslim calibrate --fit-rotation``,
written into the bias file (schema 2), applied by a cache with ``rotate='fitted'``."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch
from gguf import GGUFReader
from transformers import DynamicCache

from conftest import tiny_model
from kvslim import SlimCache
from kvslim.cache import build as build_mod
from kvslim.cache.hadamard import Hadamard
from kvslim.calibration.biasfile import read_bias_file, write_bias_file
from kvslim.calibration.calibrate import collect_k_means_from_ids
from kvslim.calibration.meancenter import BiasSet
from kvslim.calibration.rotation import FittedRotation, fit_rotation
from kvslim.formats import make_codec
from kvslim.formats.floats import NoneFormat
from kvslim.generate import forward

FINGERPRINT = "sha256:" + "ab" * 32


class ExactFormat(NoneFormat):
    """Stores the tokens as given, but flagged lossy: a body in the rotated basis, read by the kernels."""

    lossy = True


@pytest.fixture
def exact_codecs(monkeypatch):
    monkeypatch.setattr(build_mod, "cache_codec", lambda cfg, fmt, role: ExactFormat().codec(role))
    monkeypatch.setitem(build_mod._FP_DTYPES, "auto", None)


def _ids(length, seed):
    return torch.randint(3, 128, (1, length), generator=torch.Generator().manual_seed(seed))


def _shaped_model():
    """The tiny llama with K and V projections given a decaying spectrum and correlated channels, as real
    models' K/V have (a few dominant directions; random-weight projections are near isotropic)."""
    model = tiny_model("llama")
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.k_proj, layer.self_attn.v_proj):
                d = 32
                q, _ = torch.linalg.qr(torch.randn(d, d, generator=g))
                mix = q @ torch.diag(torch.logspace(0.6, -0.6, d)) @ q.T  # (32, 32): spectrum 4 .. 0.25
                w = proj.weight.view(2, d, -1)  # (H_kv, D, hidden)
                w.copy_(mix @ w)
    return model


def _calibrate(model, *, pre_rope=False, seed=3, length=600):
    """A fit on ``length`` random tokens (>= 512: no noisy-estimate warning), K unrotated."""
    return collect_k_means_from_ids(
        model, _ids(length, seed)[0], ctx=200, progress=False, fingerprint=FINGERPRINT,
        fit_rotation=True, pre_rope=pre_rope, rotate=False,
    )  # fmt: skip


def _logits(model, cache, ids, prefill=20):
    with torch.no_grad():
        out = [forward(model, ids[:, :prefill], cache, logits_to_keep=0)]
        for t in range(prefill, ids.shape[1]):
            out.append(forward(model, ids[:, t : t + 1], cache, logits_to_keep=0))
    return torch.cat(out, dim=1)


# -- the matrix ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("d, block", [(32, 32), (96, 32)])
def test_fitted_matrix_is_orthogonal_and_spreads_the_variance(d, block):
    g = torch.Generator().manual_seed(0)
    a = torch.randn(2, d, d, generator=g, dtype=torch.float64) * torch.logspace(1, -2, d, dtype=torch.float64)
    cov = a @ a.transpose(-1, -2)  # (2, D, D): eigenvalues spread over 6 decades
    r = fit_rotation(cov, block)
    eye = torch.eye(d, dtype=torch.float64)
    assert (r @ r.transpose(-1, -2) - eye).abs().max() < 1e-12
    r32 = r.float()  # what the file stores
    assert (r32.double() @ r32.double().transpose(-1, -2) - eye).abs().max() < 1e-6  # fp32 tolerance
    var = torch.diagonal(r @ cov @ r.transpose(-1, -2), dim1=-2, dim2=-1)  # (2, D): per-channel variance
    if d == block:  # one Hadamard block: every channel gets exactly the mean eigenvalue
        torch.testing.assert_close(var, cov.diagonal(dim1=-2, dim2=-1).mean(-1, keepdim=True).expand_as(var))
    else:  # blocks share the eigenvalues round-robin: far more even than the eigenbasis alone
        assert float(var.max() / var.min()) < 10
    h_var = torch.diagonal(
        Hadamard.for_head_dim(d).matrix(dtype=torch.float64)
        @ cov
        @ Hadamard.for_head_dim(d).matrix(dtype=torch.float64),
        dim1=-2,
        dim2=-1,
    )
    assert float((var.max(-1).values / var.min(-1).values).max()) < float(
        (h_var.max(-1).values / h_var.min(-1).values).min()
    )
    assert torch.equal(fit_rotation(cov, block), r)  # deterministic


def test_apply_and_inverse_are_the_matrix_and_its_transpose():
    g = torch.Generator().manual_seed(1)
    r = fit_rotation(torch.eye(16, dtype=torch.float64).expand(3, 16, 16) + 0.1, 16).float()
    rot = FittedRotation(r)
    x = torch.randn(2, 3, 5, 16, generator=g)
    want = torch.einsum("hed,bhtd->bhte", r.double(), x.double())
    torch.testing.assert_close(rot.apply(x).double(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rot.inverse(rot.apply(x)), x, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="expected \\(B, 3, T, 16\\)"):
        rot.apply(torch.zeros(2, 2, 5, 16))


# -- the file --------------------------------------------------------------------------------------------


def test_round_trip_through_the_file_is_bit_exact_and_deterministic(tmp_path):
    model = tiny_model("llama")
    bias = _calibrate(model)
    assert set(bias.rotations) == {"k", "v"} and len(bias.rotations["k"]) == 2
    for r in bias.rotations["k"] + bias.rotations["v"]:
        assert r.shape == (2, 32, 32) and r.dtype == torch.float32
        assert (
            r.double() @ r.double().transpose(-1, -2) - torch.eye(32, dtype=torch.float64)
        ).abs().max() < 1e-5
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    write_bias_file(a, bias)
    back = read_bias_file(a)
    assert back.rotation == "pca-hadamard" and back.pre_rope is False
    for role in ("k", "v"):
        for x, y in zip(bias.rotations[role], back.rotations[role], strict=True):
            assert torch.equal(x, y)
    for x, y in zip(bias.tensors, back.tensors, strict=True):
        assert torch.equal(x, y)
    write_bias_file(b, back)  # the read-back set writes the same bytes
    assert hashlib.sha256(a.read_bytes()).digest() == hashlib.sha256(b.read_bytes()).digest()
    reader = GGUFReader(str(a))
    assert int(reader.get_field("kv_mean_center.schema_version").contents()) == 2
    names = [t.name for t in reader.tensors]
    assert names == [
        "kv_bar.blk.0.k", "kv_bar.blk.1.k", "kv_rot.blk.0.k", "kv_rot.blk.1.k", "kv_rot.blk.0.v", "kv_rot.blk.1.v",
    ]  # fmt: skip
    # the fit is deterministic: a second calibration gives the same bytes
    write_bias_file(b, _calibrate(model))
    assert a.read_bytes() == b.read_bytes()


def test_old_schema_file_still_reads_and_refuses_fitted_with_one_line(tmp_path):
    model = tiny_model("llama")
    old = BiasSet(
        [torch.randn(2, 32) * 0.1 for _ in range(2)], model_fingerprint=FINGERPRINT, cache_type="q4_0"
    )
    path = tmp_path / "old.gguf"
    write_bias_file(path, old)  # no rotations: schema 1, the bytes of before
    assert int(GGUFReader(str(path)).get_field("kv_mean_center.schema_version").contents()) == 1
    back = read_bias_file(path)
    assert back.rotations is None and back.rotation is None
    assert all(torch.equal(x, y) for x, y in zip(old.tensors, back.tensors))
    SlimCache(
        kv_quantize="q4_0", rotate="none", mean_center=path, config=model.config
    )  # still serves centering
    with pytest.raises(ValueError) as e:
        SlimCache(kv_quantize="int2", rotate="fitted", mean_center=path, config=model.config)
    assert "holds no fitted rotation" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ValueError) as e:
        SlimCache(kv_quantize="int2", rotate="fitted", config=model.config)
    assert "needs the calibration file" in str(e.value) and "\n" not in str(e.value)


def test_a_pre_rope_fit_refuses_a_post_rope_cache(tmp_path):
    model = tiny_model("llama")
    path = tmp_path / "pre.gguf"
    write_bias_file(path, _calibrate(model, pre_rope=True))
    SlimCache(
        kv_quantize="int2", rotate="fitted", mean_center=path, config=model.config
    )  # pre_rope from the file
    with pytest.raises(ValueError, match="pre-RoPE"):
        SlimCache(kv_quantize="int2", rotate="fitted", pre_rope=False, mean_center=path, config=model.config)


# -- the cache -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("attn", ["sdpa", "kvslim"])
@pytest.mark.parametrize("pre_rope", [False, True])
def test_fitted_rotation_with_an_exact_format_gives_the_plain_logits(exact_codecs, tmp_path, attn, pre_rope):
    """An exact (lossy-flagged) format stored in the fitted basis: DynamicCache's logits to 1e-4 (fp32 matmuls
    through R and R^T), through both attention paths and the pre-RoPE transform."""
    model = tiny_model("llama", attn_implementation=attn)
    path = tmp_path / "fit.gguf"
    write_bias_file(path, _calibrate(tiny_model("llama"), pre_rope=pre_rope))
    ids = _ids(60, 5)
    ref = _logits(model, DynamicCache(config=model.config), ids)
    cache = SlimCache(
        kv_quantize="int8", residual=4, group_size=2, rotate="fitted", mean_center=path, config=model.config
    )
    assert cache.rotate == "fitted" and cache.pre_rope == pre_rope
    got = _logits(model, cache, ids)
    assert cache.stores()[0].k.n_body > 0
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("fmt, bound", [("int8", 0.1), ("q8_0", 0.1)])
def test_fitted_rotation_with_8_bits_stays_near_the_unrotated_cache(tmp_path, fmt, bound):
    """8-bit storage in the fitted basis vs unrotated: the logits of the tiny model (|logit| ~ 10) within
    ``bound`` of each other (measured: 0.03-0.05 each from DynamicCache), q8_0 with the file's bias centered."""
    model = tiny_model("llama")
    path = tmp_path / "fit.gguf"
    write_bias_file(path, _calibrate(model))
    ids = _ids(60, 5)
    plain = _logits(model, SlimCache(kv_quantize=fmt, residual=0, rotate="none", config=model.config), ids)
    fitted_cache = SlimCache(
        kv_quantize=fmt, residual=0, rotate="fitted", mean_center=path, config=model.config
    )
    fitted = _logits(model, fitted_cache, ids)
    assert float((fitted - plain).abs().max()) < bound
    assert (fitted_cache.stores()[0].k.basis.bias is not None) == (fmt == "q8_0")


def _roundtrip_error(fmt, role, x, rot):
    """Relative squared error of ``x`` (B, H, T, D) stored in ``fmt`` in basis ``rot`` and decoded back."""
    codec = make_codec(fmt, role, group_size=32)
    y = rot.apply(x)
    back = rot.inverse(codec.decode(codec.encode(y), torch.float32))
    return float((back - x).pow(2).sum() / x.pow(2).sum())


def test_fitted_basis_lowers_int2_error_on_the_calibration_distribution():
    """K and V of the shaped tiny model (:func:`_shaped_model`) on held-out tokens of the calibration
    distribution, int2 per-channel K / per-token V: the fitted basis's round-trip error vs the Hadamard's.
    Measured: V 0.63x and 0.73x (layers 0, 1), K 1.01x and 1.01x — a per-channel quantizer's error is the sum of
    the channel variances, which no rotation changes (docs/quality.md, "Fitted rotation")."""
    model = _shaped_model()
    bias = _calibrate(model, length=1200)
    seen = {}
    cache = SlimCache(
        kv_quantize="none", config=model.config, observe=lambda i, k, v: seen.setdefault(i, (k, v))
    )
    with torch.no_grad():
        model(_ids(256, 11), cache=cache, use_cache=True)
    had = Hadamard.for_head_dim(32)
    ratios = {}
    for il, (k, v) in seen.items():
        for role, x in (("k", k), ("v", v)):
            fitted = _roundtrip_error("int2", role, x, FittedRotation(bias.rotations[role][il]))
            ratios[(il, role)] = fitted / _roundtrip_error("int2", role, x, had)
    assert np.mean([r for (_, role), r in ratios.items() if role == "v"]) < 0.9
    assert max(r for (_, role), r in ratios.items() if role == "k") < 1.05
    assert np.mean(list(ratios.values())) < 1.0


# -- bytes -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("v_fmt", ["int4", "none"])
def test_nbytes_and_bits_count_the_fitted_rotations_once_per_cache(tmp_path, v_fmt):
    """A fitted cache holds exactly the bytes of the same cache in the Hadamard basis (same codes, scales and
    residual) plus its matrices: (H_kv, D, D) float32 per layer and encoded role, once per cache — in nbytes,
    projected_nbytes, kv_bits and the memory formula alike."""
    from kvslim import parse_spec
    from kvslim.evaluate.memory import ModelShape, cache_bytes, kv_bits

    model = tiny_model("llama")
    bias = _calibrate(model)
    path = tmp_path / "fit.gguf"
    write_bias_file(path, bias)
    roles = "kv" if v_fmt != "none" else "k"
    want = sum(t.numel() * 4 for role in roles for t in bias.rotations[role])
    assert want == len(roles) * 2 * 2 * 32 * 32 * 4  # roles x layers x (H_kv, D, D) float32
    base = f"int4,v={v_fmt},residual=8,group=8,pre_rope=0"
    specs = {"fitted": f"{base},rotate=fitted,mean_center={path}", "plain": f"{base},rotate={roles}"}
    caches = {
        name: SlimCache.from_config(parse_spec(spec), config=model.config) for name, spec in specs.items()
    }
    assert caches["fitted"].rotate == "fitted" and caches["plain"].rotate in ("kv", "k")
    assert caches["fitted"].nbytes() - caches["plain"].nbytes() == want  # before any token, too
    ids = _ids(45, 5)
    for cache in caches.values():
        _logits(model, cache, ids)
    fitted, plain = caches["fitted"], caches["plain"]
    assert fitted.stores()[0].k.n_body > 0
    assert fitted.components()["rotation"] == want and plain.components()["rotation"] == 0
    assert fitted.nbytes() - plain.nbytes() == want
    assert fitted.projected_nbytes(100) - plain.projected_nbytes(100) == want
    assert kv_bits(fitted).bytes - kv_bits(plain).bytes == want
    assert kv_bits(fitted).bits_per_element > kv_bits(plain).bits_per_element
    shape = ModelShape.from_config(model.config)
    formula = {name: cache_bytes(shape, parse_spec(spec), 45, prefill=20)[1] for name, spec in specs.items()}
    assert formula["fitted"] - formula["plain"] == want
    assert formula["fitted"] == kv_bits(fitted).bytes  # the formula is the real cache's count


def test_caches_built_from_one_bias_set_share_its_matrices(tmp_path):
    """The batch engine reads its bias file once and builds every row's cache from that BiasSet: the caches
    hold the very same tensors (no copy per cache), and each counts them once (rotation_nbytes' docstring)."""
    from kvslim.engine.gate import Gate

    model = tiny_model("llama")
    path = tmp_path / "fit.gguf"
    write_bias_file(path, _calibrate(model))
    shared = Gate.read_bias(path)
    a, b = (
        SlimCache(kv_quantize="int2", rotate="fitted", mean_center=shared, config=model.config) for _ in range(2)
    )
    for role in "kv":
        for il, m in enumerate(shared.rotations[role]):
            ptrs = {c._storage.hadamard[role].for_layer(il).matrix.data_ptr() for c in (a, b)}
            assert ptrs == {m.data_ptr()}
    want = sum(t.numel() * 4 for role in "kv" for t in shared.rotations[role])
    assert a.rotation_nbytes() == b.rotation_nbytes() == want


# -- pre-RoPE keys in the C kernels ----------------------------------------------------------------------


def _random_rotation(h, d, seed):
    """(H, D, D) float32 orthogonal, dense (no Hadamard structure)."""
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(h, d, d, generator=g, dtype=torch.float64))
    return q.float()


@pytest.mark.parametrize("fmt", ["int2", "int4", "int8", "q4_0", "q8_0", "fp8", "fp16"])
@pytest.mark.parametrize("centered", [False, True])
def test_c_transform_kernels_take_a_fitted_rotation_as_the_reference_does(fmt, centered):
    """k_scores of pre-RoPE keys stored in a fitted basis (bias added, R^T, then RoPE per token): the C kernels
    (dense R^T in the tile) against the torch reference (matmul by R), tight, and both against decoding in
    float64. The rotation is undone per key, before its RoPE: R does not commute with RoPE's angles."""
    from kvslim import kernels
    from kvslim.cache.rotary import Rotary
    from kvslim.kernels import reference

    g = torch.Generator().manual_seed(10)
    b, h, t, d, m = 2, 3, 77, 64, 5
    codec = make_codec(fmt, "k", group_size=8)
    x = torch.randn(b, h, t - t % codec.token_group + codec.token_group, d, generator=g) * 2
    enc, offset = codec.encode(x), 0
    if codec.token_group > 1:  # the first group partly evicted, as a window leaves it
        enc, offset = enc.narrow(3, x.shape[2] - 2, 0, codec.token_group)
    n = next(iter(enc.token.values())).shape[2]
    q = torch.randn(b, h, m, d, generator=g)
    bias = torch.randn(h, d, generator=g) if centered else None
    flags = (torch.rand(b, h, n, 1, generator=g) < 0.7).to(torch.uint8) if centered else None
    r = _random_rotation(h, d, 4)
    rot = Rotary(1.0 / 10000 ** (torch.arange(0, 48, 2).float() / 48), offset=8)  # partial rotary
    pos = torch.arange(n)[None, :] + torch.tensor([[100], [7]])  # (B, n): per-row positions
    cos, sin = rot.table(pos, "cpu")
    tr = kernels.KeyTransform(bias=bias, hadamard=FittedRotation(r), cos=cos, sin=sin, rope_offset=8, centered=flags)
    calls = []
    real = reference.k_scores_transformed
    got = {}
    for backend in ("cpu", "torch"):
        kernels.set_backend(backend)
        try:
            reference.k_scores_transformed = lambda *a, **k: calls.append(1) or real(*a, **k)
            got[backend] = kernels.k_scores(q, codec, enc, offset, tr)
        finally:
            reference.k_scores_transformed = real
            kernels.set_backend(None)
        assert len(calls) == (backend == "torch")  # the C call never falls back to the reference
    keys = codec.decode(enc, torch.float64, offset)
    if bias is not None:
        keys = keys + bias.double()[None, :, None, :] * flags.double()
    keys = torch.einsum("bhte,hed->bhtd", keys, r.double())  # R^T y
    keys = rot.move(keys.float(), pos).double()
    want = q.double() @ keys.transpose(-1, -2)
    torch.testing.assert_close(got["cpu"], got["torch"], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(got["cpu"].double(), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("spec", ["int2,residual=4,group=4", "int4,sink=2,window=24,residual=4,group=4"])
def test_pre_rope_fitted_cache_through_the_c_kernels_gives_the_reference_logits(tmp_path, spec):
    """A pre-RoPE fitted cache on the tiny GQA llama (4 query heads on 2 KV heads), with and without a window
    that evicts: the logits through the C kernels equal those through the torch reference (fp32 summation
    order apart), and no score of the run goes to the reference."""
    from kvslim import kernels, parse_spec
    from kvslim.kernels import reference

    model = tiny_model("llama", attn_implementation="kvslim")
    assert model.config.num_attention_heads == 2 * model.config.num_key_value_heads
    path = tmp_path / "pre.gguf"
    write_bias_file(path, _calibrate(tiny_model("llama"), pre_rope=True))
    ids = _ids(70, 6)
    cfg = parse_spec(f"{spec},rotate=fitted,mean_center={path}")
    logits, calls = {}, []
    real = reference.k_scores_transformed
    for backend in ("cpu", "torch"):
        cache = SlimCache.from_config(cfg, config=model.config)
        assert cache.pre_rope and cache.rotate == "fitted"
        kernels.set_backend(backend)
        try:
            reference.k_scores_transformed = lambda *a, b=backend, **k: calls.append(b) or real(*a, **k)
            logits[backend] = _logits(model, cache, ids)
        finally:
            reference.k_scores_transformed = real
            kernels.set_backend(None)
        assert cache.stores()[0].k.n_body > 0
    assert "cpu" not in calls and "torch" in calls
    torch.testing.assert_close(logits["cpu"], logits["torch"], atol=1e-4, rtol=1e-4)
