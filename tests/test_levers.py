"""Low-bit levers: Hadamard rotation, pre-RoPE keys, centering in the stored basis.

Exactness is tested with an *exact* body codec (a lossy-flagged codec that stores float32 as given), so
every token really goes through the stored basis — rotated, un-rotated, centered, encoded, decoded — and
any error in a transform shows up in the logits instead of hiding behind quantization noise.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import DynamicCache

import kvslim
import kvslim.cache.build as build_mod
from conftest import tiny_config, tiny_model
from kvslim import SlimCache
from kvslim.cache.hadamard import MIN_BLOCK, Hadamard, block_size, sylvester
from kvslim.calibration.biasfile import write_bias_file
from kvslim.calibration.meancenter import BiasSet
from kvslim.formats.floats import NoneFormat
from kvslim.generate import forward

ROTATE = ["none", "k", "v", "kv"]


class ExactFormat(NoneFormat):
    """Stores the tokens as given, but flagged lossy: a body, a residual, the kernels' cast path."""

    lossy = True


@pytest.fixture
def exact_codecs(monkeypatch):
    """SlimCache builds its codecs with an exact lossy one (whatever the format name says), and keeps the
    full-precision tokens in the model's dtype (the default residual_dtype 'auto' would round an fp32
    model's to float16: not exact)."""
    monkeypatch.setattr(build_mod, "cache_codec", lambda cfg, fmt, role: ExactFormat().codec(role))
    monkeypatch.setitem(build_mod._FP_DTYPES, "auto", None)


def _ids(batch=1, length=30, seed=0):
    return torch.randint(3, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


def _left_pad(ids: torch.Tensor, pads: list[int]):
    rows, masks = [], []
    for b, p in enumerate(pads):
        rows.append(torch.cat([torch.zeros(p, dtype=torch.long), ids[b, : ids.shape[1] - p]]))
        masks.append(
            torch.cat([torch.zeros(p, dtype=torch.long), torch.ones(ids.shape[1] - p, dtype=torch.long)])
        )
    return torch.stack(rows), torch.stack(masks)


def _logits(model, cache, ids, mask=None, prefill=9, chunk=1):
    """Logits (B, T, V) of a prefill, then ``chunk`` tokens per forward (explicit pads and positions)."""
    pads = None if mask is None else (mask == 0).sum(1)
    out = []
    with torch.no_grad():
        for s, e in [(0, prefill)] + [
            (t, min(t + chunk, ids.shape[1])) for t in range(prefill, ids.shape[1], chunk)
        ]:
            m = None if mask is None else mask[:, :e]
            out.append(forward(model, ids[:, s:e], cache, pads=pads, attention_mask=m, logits_to_keep=0))
    return torch.cat(out, dim=1)


# -- the matrix ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [16, 32, 64, 128, 256, 512])
def test_hadamard_is_orthonormal_and_its_own_inverse(n):
    # an independent definition: H[i, j] = (-1)^popcount(i & j) / sqrt(n)
    sign = torch.tensor(
        [[(-1) ** bin(a & b).count("1") for b in range(n)] for a in range(n)], dtype=torch.float64
    )
    ref = sign / n**0.5  # (n, n) float64
    torch.testing.assert_close(sylvester(n), ref, atol=1e-15, rtol=0)
    h = Hadamard(n, n).matrix()  # float32, as applied
    torch.testing.assert_close(h, ref.float(), atol=0, rtol=0)
    eye = torch.eye(n)
    torch.testing.assert_close(h @ h, eye, atol=2e-6, rtol=0)  # its own inverse to fp32 rounding
    torch.testing.assert_close(h @ h.T, eye, atol=2e-6, rtol=0)  # orthonormal
    x = torch.randn(3, 5, n, generator=torch.Generator().manual_seed(n))  # (..., n)
    hx = Hadamard(n, n).apply(x)
    # H x for each row x: x @ H^T = x @ H (symmetric)
    torch.testing.assert_close(hx, (x.double() @ ref).float(), atol=5e-6, rtol=0)
    torch.testing.assert_close(Hadamard(n, n).apply(hx), x, atol=5e-6, rtol=0)


@pytest.mark.parametrize("head_dim, block", [(64, 64), (128, 128), (96, 32), (80, 16), (192, 64), (256, 256)])
def test_block_rule(head_dim, block):
    assert block_size(head_dim) == block
    h = Hadamard.for_head_dim(head_dim)
    full = h.matrix()
    torch.testing.assert_close(full @ full, torch.eye(head_dim), atol=2e-6, rtol=0)
    x = torch.randn(2, head_dim, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(h.apply(x), x @ full, atol=2e-6, rtol=0)


@pytest.mark.parametrize("head_dim", [7, 72, 100])
def test_rotation_refuses_head_dims_without_a_block(head_dim):
    with pytest.raises(ValueError, match=f"divisible by {MIN_BLOCK}"):
        block_size(head_dim)


def test_rotate_needs_a_config_and_a_block():
    with pytest.raises(ValueError, match="rotate='k' needs config"):
        SlimCache(kv_quantize="int4", rotate="k")
    model = tiny_model("llama", hidden_size=96, num_attention_heads=4, num_key_value_heads=2)  # head_dim 24
    with pytest.raises(ValueError, match="rotate='kv': k: a Hadamard rotation needs"):
        SlimCache(kv_quantize="int4", rotate="kv", config=model.config)


# -- identity with an exact format ------------------------------------------------------------------------


@pytest.mark.parametrize("attn", ["sdpa", "kvslim"])
@pytest.mark.parametrize("pre_rope", [False, True])
@pytest.mark.parametrize("rotate", ROTATE)
@pytest.mark.parametrize("residual, group", [(0, 1), (4, 2)])
def test_levers_give_the_plain_cache_logits(exact_codecs, rotate, pre_rope, attn, residual, group):
    """Every rotation x pre-RoPE combination, both attention paths, GQA (4 query / 2 KV heads), a
    left-padded batch: the logits of DynamicCache to 1e-5."""
    model = tiny_model("llama", attn_implementation=attn)
    ids, mask = _left_pad(_ids(batch=3, length=26, seed=1), [0, 2, 5])
    ref = _logits(model, DynamicCache(config=model.config), ids, mask)
    cache = SlimCache(
        kv_quantize="q4_0",
        residual=residual,
        group_size=group,
        rotate=rotate,
        pre_rope=pre_rope,
        config=model.config,
    )
    assert cache.compressed_attention == (attn == "kvslim")
    got = _logits(model, cache, ids, mask)
    assert cache.stores()[0].k.n_body > 0  # tokens really went through the encoded body
    keep = mask.bool()
    torch.testing.assert_close(got[keep], ref[keep], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("attn", ["sdpa", "kvslim"])
def test_sinks_without_a_window_with_every_lever(exact_codecs, attn):
    """sink=2 without a window (the first tokens kept apart at full precision, nothing evicted) with rotation,
    pre-RoPE and a left-padded batch: the plain cache's logits."""
    model = tiny_model("llama", attn_implementation=attn)
    ids, mask = _left_pad(_ids(batch=2, length=24, seed=14), [0, 3])
    ref = _logits(model, DynamicCache(config=model.config), ids, mask)
    cache = SlimCache(
        kv_quantize="q4_0", sink=2, residual=4, group_size=2, rotate="kv", pre_rope=True, config=model.config
    )
    got = _logits(model, cache, ids, mask)
    store = cache.stores()[0]
    assert (store.sink_len, store.stored, store.seen) == (2, 24, 24)
    keep = mask.bool()
    torch.testing.assert_close(got[keep], ref[keep], atol=1e-5, rtol=1e-5)


def test_sinks_without_a_window_are_never_quantized():
    model = tiny_model("llama")
    ids = _ids(length=30, seed=15)
    dyn = DynamicCache(config=model.config)
    cache = SlimCache(
        kv_quantize="int2", sink=3, residual=0, group_size=4, residual_dtype="model", config=model.config
    )
    with torch.no_grad():
        forward(model, ids, dyn)
        forward(model, ids, cache)
    keys, values = cache.stores()[1].read(torch.float32)
    assert cache.stored_tokens() == 30 and cache.policy.capacity is None
    assert torch.equal(keys[:, :, :3], dyn.layers[1].keys[:, :, :3])  # the first tokens: exactly the model's
    assert torch.equal(values[:, :, :3], dyn.layers[1].values[:, :, :3])
    assert not torch.equal(keys[:, :, 3:6], dyn.layers[1].keys[:, :, 3:6])  # the rest: int2


@pytest.mark.parametrize("attn", ["sdpa", "kvslim"])
@pytest.mark.parametrize("rotate, pre_rope", [("kv", False), ("none", True), ("kv", True)])
@pytest.mark.parametrize("positions", ["original", "cache"])
def test_levers_compose_with_streaming_and_rebasing(exact_codecs, rotate, pre_rope, attn, positions):
    """Sinks + window far past the window, re-based position ids, a left-padded batch (whose sinks slide over
    the pads, taking keys back from the stream): the levers change nothing."""
    model = tiny_model("llama", attn_implementation=attn)
    ids, mask = _left_pad(_ids(batch=2, length=70, seed=2), [0, 13])
    kw = dict(
        kv_quantize="q4_0",
        residual=4,
        group_size=2,
        sink=2,
        window=9,
        positions=positions,
        config=model.config,
    )
    plain = SlimCache(**kw)
    plain.rebase_period = 16
    levers = SlimCache(rotate=rotate, pre_rope=pre_rope, **kw)
    levers.rebase_period = 16
    a = _logits(model, plain, ids, mask, chunk=3)
    b = _logits(model, levers, ids, mask, chunk=3)
    keep = mask.bool()
    torch.testing.assert_close(b[keep], a[keep], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("attn", ["sdpa", "kvslim"])
@pytest.mark.parametrize("rotate, pre_rope", [("none", False), ("k", False), ("none", True), ("kv", True)])
def test_centering_in_any_basis_is_exact(exact_codecs, rotate, pre_rope, attn):
    """A bias (any values) in the stored basis is subtracted on encode and added back on read: the plain
    cache's logits, whatever else is kept at full precision (sinks, residual) — no softmax invariance."""
    model = tiny_model("llama", attn_implementation=attn)
    ids, mask = _left_pad(_ids(batch=2, length=24, seed=3), [0, 3])
    ref = _logits(model, DynamicCache(config=model.config), ids, mask)
    g = torch.Generator().manual_seed(4)
    bias = BiasSet(
        [torch.randn(2, 32, generator=g) * 5 for _ in range(2)], k_rot=rotate != "none", pre_rope=pre_rope
    )
    cache = SlimCache(
        kv_quantize="q4_0", residual=4, group_size=2, rotate=rotate, pre_rope=pre_rope, mean_center=bias,
        config=model.config,
    )  # fmt: skip
    got = _logits(model, cache, ids, mask)
    keep = mask.bool()
    torch.testing.assert_close(got[keep], ref[keep], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fmt", ["q4_0", "q5_0", "q8_0"])
@pytest.mark.parametrize("rotated", [False, True])
def test_centering_never_makes_a_key_worse(fmt, rotated):
    """Per token, the stored key is at least as close as without centering (each token is centered only
    where that lowers its own error): a short "sink" key far from the mean stays uncentered, typical keys
    near the mean are centered."""
    from kvslim.cache.basis import CENTERED, BodyBasis
    from kvslim.cache.stream import Stream
    from kvslim.formats import make_codec

    g = torch.Generator().manual_seed(12)
    mean = torch.randn(2, 64, generator=g) * 4
    x = mean[None, :, None, :] + torch.randn(1, 2, 40, 64, generator=g)  # typical keys: mean + noise
    x[:, :, 0] = torch.randn(1, 2, 64, generator=g) * 0.2  # a sink: short, far from the mean
    had = Hadamard.for_head_dim(64) if rotated else None
    basis = BodyBasis(had, had.apply(mean) if rotated else mean)
    codec = make_codec(fmt, "k")
    cent, plain = Stream(codec, 0, basis=basis), Stream(codec, 0, basis=BodyBasis(had))
    cent.append(x)
    plain.append(x)
    err_c = (cent.materialize(torch.float32) - x).pow(2).sum(-1)
    err_p = (plain.materialize(torch.float32) - x).pow(2).sum(-1)
    assert bool((err_c <= err_p * (1 + 1e-5) + 1e-9).all())
    flags = cent.body().token[CENTERED][..., 0]
    assert not bool(flags[:, :, 0].any())  # the sink is stored as it is
    assert float(flags[:, :, 1:].float().mean()) > 0.9  # the rest centered
    assert float(err_c[:, :, 1:].mean()) < 0.5 * float(err_p[:, :, 1:].mean())


# -- pre-RoPE and the model's RoPE variants ----------------------------------------------------------------

ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    "llama3": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 16,
    },
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16},
}  # fmt: skip


@pytest.mark.parametrize("rope", list(ROPES))
def test_pre_rope_round_trip_for_scaled_ropes(exact_codecs, rope):
    """Keys un-rotated on write with the model's own RoPE and rotated again on read equal the keys the model
    produced (layer 0 stores exactly what a DynamicCache stores) to 1e-5; past the original length for the
    scaled variants (dynamic NTK scales its frequencies for a forward longer than max_position_embeddings)."""
    model = tiny_model("llama", max_position_embeddings=16, rope_parameters=ROPES[rope])
    ids = _ids(length=40, seed=5)
    dyn = DynamicCache(config=model.config)
    slim = SlimCache(kv_quantize="q4_0", residual=0, group_size=1, pre_rope=True, config=model.config)
    with torch.no_grad():
        a = forward(model, ids, dyn, logits_to_keep=0)
        b = forward(model, ids, slim, logits_to_keep=0)
    keys, _ = slim.stores()[0].read(torch.float32)
    torch.testing.assert_close(keys, dyn.layers[0].keys, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)


def test_pre_rope_dynamic_ntk_past_the_original_length_warns(exact_codecs):
    model = tiny_model("llama", max_position_embeddings=16, rope_parameters=ROPES["dynamic"])
    ids = _ids(length=24, seed=16)
    cache = SlimCache(kv_quantize="q4_0", residual=0, group_size=1, pre_rope=True, config=model.config)
    a = _logits(model, DynamicCache(config=model.config), ids, prefill=8)
    with pytest.warns(UserWarning, match="dynamic NTK RoPE past the model's original length"):
        b = _logits(model, cache, ids, prefill=8)
    torch.testing.assert_close(b[:, :16], a[:, :16], atol=1e-5, rtol=1e-5)  # exact up to the original length


@pytest.mark.parametrize("rope", ["default", "linear", "llama3", "yarn"])
def test_pre_rope_decode_matches_for_static_ropes(exact_codecs, rope):
    model = tiny_model("llama", max_position_embeddings=16, rope_parameters=ROPES[rope])
    kvslim.enable(model)
    ids = _ids(length=30, seed=6)
    a = _logits(model, DynamicCache(config=model.config), ids)
    b = _logits(
        model,
        SlimCache(kv_quantize="q4_0", residual=4, group_size=2, pre_rope=True, config=model.config),
        ids,
    )
    torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)


def test_pre_rope_refuses_other_ropes():
    cfg = tiny_config(
        "llama",
        max_position_embeddings=64,
        rope_parameters={
            "rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 32,
            "short_factor": [1.0] * 16, "long_factor": [2.0] * 16,
        },
    )  # fmt: skip
    with pytest.raises(
        ValueError, match="pre_rope=True supports RoPE types default, linear, dynamic, llama3, yarn"
    ):
        SlimCache(kv_quantize="int4", pre_rope=True, config=cfg)
    with pytest.raises(ValueError, match="pre_rope=True needs config"):
        SlimCache(kv_quantize="int4", pre_rope=True)


# -- bias files in a basis ---------------------------------------------------------------------------------


def _bias(k_rot=False, pre_rope=False, scale=0.5):
    g = torch.Generator().manual_seed(7)
    return BiasSet(
        [torch.randn(2, 32, generator=g) * scale for _ in range(2)], k_rot=k_rot, pre_rope=pre_rope
    )


@pytest.mark.parametrize(
    "file_rot, file_pre, rotate, pre_rope, match",
    [
        (False, False, "k", False, r"unrotated \(k_rot=false\) K basis, but this cache stores K rotated"),
        (True, False, "none", False, r"rotated \(k_rot=true\) K basis, but this cache stores K unrotated"),
        (True, False, "v", False, "k_rot"),  # rotating V alone leaves K unrotated
        (
            False,
            False,
            "none",
            True,
            r"post-RoPE \(no k_pre_rope\) K basis, but this cache stores K pre-RoPE",
        ),
        (
            False,
            True,
            "none",
            False,
            r"pre-RoPE \(k_pre_rope=true\) K basis, but this cache stores K post-RoPE",
        ),
    ],
)
def test_basis_mismatch_is_an_error(tmp_path, file_rot, file_pre, rotate, pre_rope, match):
    model = tiny_model("llama")
    path = tmp_path / "b.gguf"
    write_bias_file(path, _bias(file_rot, file_pre))
    with pytest.raises(ValueError, match=match):
        SlimCache(kv_quantize="q4_0", rotate=rotate, pre_rope=pre_rope, mean_center=path, config=model.config)
    # the matching basis loads
    SlimCache(
        kv_quantize="q4_0", rotate="kv" if file_rot else "none", pre_rope=file_pre, mean_center=path,
        config=model.config,
    )  # fmt: skip


def test_calibrate_in_the_stored_basis(tmp_path):
    from kvslim.calibration.calibrate import collect_k_means_from_ids
    from kvslim.formats import quantize_ggml  # noqa: F401  (the q4_0 format the bias is for)

    model = tiny_model("llama")
    ids = _ids(length=96, seed=8)[0]
    kw = dict(ctx=48, progress=False, fingerprint="sha256:" + "ab" * 32)
    with pytest.warns(UserWarning, match="noisy estimate"):
        plain = collect_k_means_from_ids(model, ids, rotate=False, **kw)
        rot = collect_k_means_from_ids(model, ids, rotate=True, **kw)
        pre = collect_k_means_from_ids(model, ids, rotate=False, pre_rope=True, **kw)
        both = collect_k_means_from_ids(model, ids, rotate=True, pre_rope=True, **kw)
    assert (plain.k_rot, rot.k_rot, pre.k_rot, both.k_rot) == (False, True, False, True)
    assert (plain.pre_rope, rot.pre_rope, pre.pre_rope, both.pre_rope) == (False, False, True, True)
    h = Hadamard.for_head_dim(32)
    for a, b, c, d in zip(plain.tensors, rot.tensors, pre.tensors, both.tensors, strict=True):
        torch.testing.assert_close(b, h.apply(a), atol=1e-5, rtol=1e-5)  # the mean is linear
        torch.testing.assert_close(d, h.apply(c), atol=1e-5, rtol=1e-5)
        assert (a - c).abs().max() > 1e-3  # pre-RoPE is another basis, not a rotation of the mean
    # pre-RoPE means are means of layer 0's keys un-rotated at their positions (an independent computation)
    dyn = DynamicCache(config=model.config)
    with torch.no_grad():
        for s in range(0, 96, 48):
            dyn = DynamicCache(config=model.config)
            model(ids[None, s : s + 48], cache=dyn, use_cache=True)
            if s == 0:
                first = dyn.layers[0].keys
            else:
                second = dyn.layers[0].keys
    rot0 = SlimCache(config=model.config).rotary
    pos = torch.arange(48)
    unrot = torch.cat(
        [rot0.move(first, -pos[None].expand(1, -1)), rot0.move(second, -pos[None].expand(1, -1))], 2
    )
    torch.testing.assert_close(pre.tensors[0], unrot.double().mean(dim=(0, 2)).float(), atol=1e-5, rtol=1e-5)
    path = tmp_path / "rot.gguf"
    write_bias_file(path, rot)
    from kvslim.calibration.biasfile import read_bias_file

    back = read_bias_file(path)
    assert back.k_rot is True and back.pre_rope is False
    write_bias_file(tmp_path / "both.gguf", both)
    assert read_bias_file(tmp_path / "both.gguf").pre_rope is True
    SlimCache(kv_quantize="q4_0", rotate="k", mean_center=path, config=model.config)


@pytest.mark.slow
def test_calibrate_cli_records_the_basis(tmp_path, license_text):
    """``kvslim calibrate --kv-rotate k --kv-pre-rope`` writes both basis keys; the file loads into the
    matching cache of the embedded model and is refused by the plain one."""
    from kvslim.calibration.biasfile import read_bias_file
    from kvslim.cli import main
    from kvslim.models import load_model

    text = tmp_path / "t.txt"
    text.write_text(license_text)
    out = tmp_path / "b.gguf"
    args = ["calibrate", "--text", str(text), "--ctx", "128", "--max-tokens", "128", "--kv-rotate", "k",
            "--kv-pre-rope", "--out", str(out), "--no-progress"]  # fmt: skip
    assert main(args) == 0
    b = read_bias_file(out)
    assert (b.k_rot, b.pre_rope) == (True, True)
    model, _ = load_model(None)
    SlimCache(kv_quantize="q4_0", rotate="k", pre_rope=True, mean_center=out, config=model.config,
              allow_other_model=True)  # fmt: skip
    with pytest.raises(ValueError, match="k_rot"):
        SlimCache(kv_quantize="q4_0", rotate="none", pre_rope=False, mean_center=out, config=model.config)
    auto = SlimCache(kv_quantize="q4_0", mean_center=out, config=model.config, allow_other_model=True)
    assert (auto.rotate, auto.pre_rope) == ("kv", True)  # 'auto' takes the basis the file records


def _llama_cpp_channel(d: int) -> np.ndarray:
    """The index map of llama.cpp's converter (convert_hf_to_gguf.py ``permute``), written out again:
    the q/k rows of one head, ``w.reshape(2, D/2, ...).swapaxes(0, 1)`` -> llama.cpp row ``2i + r`` is
    transformers row ``r * D/2 + i``. Returns src[c] = transformers channel of llama.cpp channel c."""
    rows = np.arange(d).reshape(2, d // 2).swapaxes(0, 1).reshape(d)
    return rows


def _ggml_hadamard(n: int) -> np.ndarray:
    """llama.cpp's ggml_gen_hadamard, written out again in float32."""
    data = np.zeros((n, n), dtype=np.float32)
    data[0, 0] = np.float32(1.0 / np.sqrt(np.float32(n)))
    s = 1
    while s < n:
        for i in range(s):
            for j in range(s):
                val = data[i, j]
                data[i + s, j] = val
                data[i, j + s] = val
                data[i + s, j + s] = -val
        s *= 2
    return data


def test_fork_rotated_file_in_llama_cpp_order_centers_what_kvslim_stores(tmp_path):
    """A fork file (k_rot = true, llama.cpp's channel order, 1-D tensors, no kvslim keys), written here by an
    independent GGUF writer from keys permuted and rotated the way llama.cpp does (H P k), loads into a
    rotating kvslim cache as the mean of what kvslim stores (H k, transformers' order)."""
    from gguf import GGUFWriter

    model = tiny_model("llama")  # model_type llama: llama.cpp permutes K
    d = 32
    ids = _ids(length=64, seed=9)
    dyn = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, cache=dyn, use_cache=True)
    src, hm = _llama_cpp_channel(d), _ggml_hadamard(d)
    want, fork = [], {}
    for il in range(2):
        k = dyn.layers[il].keys[0].double().numpy()  # (H, T, D), transformers' order, after RoPE
        llama_k = k[..., src]  # llama.cpp's order
        fork[il] = (
            np.einsum("ij,htj->hti", hm.astype(np.float64), llama_k).mean(axis=1).astype(np.float32)
        )  # H P k
        want.append(torch.from_numpy(np.einsum("ij,htj->hti", hm.astype(np.float64), k).mean(axis=1)).float())
    path = tmp_path / "fork.gguf"
    w = GGUFWriter(str(path), arch="")
    w.add_type("kv-mean-center")
    w.add_string("kv_mean_center.model_sha256", "0123456789abcdef" * 4)  # the fork's GGUF-file hash
    w.add_bool("kv_mean_center.k_rot", True)
    for il in range(2):
        w.add_tensor(f"kv_bar.blk.{il}.k", fork[il].reshape(-1))  # 1-D, as the fork writes
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    cache = SlimCache(kv_quantize="q4_0", rotate="k", mean_center=path, config=model.config)
    for il in range(2):
        torch.testing.assert_close(cache.stores()[il].k_bias, want[il], atol=1e-5, rtol=1e-5)
    # and kvslim's own writer round-trips through llama.cpp's order
    from kvslim.calibration.channelorder import from_llama_cpp_order, to_llama_cpp_order

    ours = BiasSet([t.clone() for t in want], k_rot=True)
    there = to_llama_cpp_order(ours, "llama")
    for il in range(2):
        torch.testing.assert_close(there.tensors[il], torch.from_numpy(fork[il]), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(
            from_llama_cpp_order(there, "llama").tensors[il], want[il], atol=1e-5, rtol=1e-5
        )
    with pytest.raises(ValueError, match="no llama.cpp counterpart"):
        to_llama_cpp_order(BiasSet([t.clone() for t in want], pre_rope=True), "llama")


# -- the transformed score kernels -------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("fmt", ["int2", "int4", "int8", "q4_0", "q8_0", "q5_1", "fp8", "fp16", "bf16"])
@pytest.mark.parametrize("rotated, centered", [(False, False), (True, True), (False, True)])
def test_transformed_scores_match_decode_then_transform(backend, fmt, rotated, centered):
    """k_scores with a KeyTransform (bias, Hadamard, RoPE per token) equals decoding the keys, transforming
    them in float64 and taking the dot products — on every backend that serves the call."""
    from kvslim import kernels
    from kvslim.cache.rotary import Rotary
    from kvslim.formats import make_codec

    g = torch.Generator().manual_seed(10)
    b, h, t, d, m = 2, 3, 77, 64, 5
    codec = make_codec(fmt, "k", group_size=8)
    x = torch.randn(b, h, t - t % codec.token_group + codec.token_group, d, generator=g) * 2
    enc = codec.encode(x)
    offset = 3 if codec.token_group > 1 else 0
    enc, offset = (
        enc.narrow(offset, x.shape[2] - 2, 0, codec.token_group) if codec.token_group > 1 else (enc, 0)
    )
    n = next(iter(enc.token.values())).shape[2]
    q = torch.randn(b, h, m, d, generator=g)
    bias = torch.randn(h, d, generator=g) if centered else None
    had = Hadamard.for_head_dim(d) if rotated else None
    rot = Rotary(
        1.0 / 10000 ** (torch.arange(0, 48, 2).float() / 48), offset=8
    )  # partial rotary after 8 channels
    pos = torch.arange(n)[None, :] + torch.tensor([[100], [7]])  # (B, n): per-row positions
    cos, sin = rot.table(pos, "cpu")
    flags = (torch.rand(b, h, n, 1, generator=g) < 0.7).to(torch.uint8) if centered else None
    tr = kernels.KeyTransform(bias=bias, hadamard=had, cos=cos, sin=sin, rope_offset=8, centered=flags)
    kernels.set_backend(backend)
    try:
        served = kernels.select(q, codec, enc)[1].k_scores_transformed
        assert (served is not None) == (backend == "cpu")  # the C kernels transform in-tile, no reference
        got = kernels.k_scores(q, codec, enc, offset, tr)
    finally:
        kernels.set_backend(None)
    keys = codec.decode(enc, torch.float64, offset)
    if bias is not None:
        keys = keys + bias.double()[None, :, None, :] * flags.double()
    if had is not None:
        keys = keys @ had.matrix(dtype=torch.float64)
    keys = rot.move(keys.float(), pos).double()
    want = q.double() @ keys.transpose(-1, -2)
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4)


# -- bytes, config, CLI ----------------------------------------------------------------------------------


def test_nbytes_count_the_angle_table():
    model = tiny_model("llama")
    kvslim.enable(model)
    cache = SlimCache(
        kv_quantize="int4", residual=0, group_size=4, rotate="kv", pre_rope=True, config=model.config
    )
    _logits(model, cache, _ids(length=20, seed=11), prefill=8)
    from test_cache import _real_tensor_bytes

    comp = cache.components()
    assert comp["rotary"] > 2 * 16 * 4  # two copies of the frequencies (moves, pre-RoPE) and the last angle table
    assert cache.nbytes() == sum(comp.values()) == _real_tensor_bytes(cache)


@pytest.mark.parametrize(
    "spec",
    [
        "q4_0,residual=0,group=1",
        "q8_0,k=q4_0,group=4,residual=8,sink=2,window=30",
        "q4_0,sink=4,residual=8,group=4",
    ],
)
@pytest.mark.parametrize("levers", ["", ",rotate=kv", ",rotate=kv,pre_rope=1"])
def test_memory_formula_counts_centering_flags(spec, levers):
    """kvslim.evaluate.cache_bytes == the stored tensors of a centered (and rotated / pre-RoPE) cache."""
    from kvslim.evaluate.memory import ModelShape, cache_bytes

    model = tiny_model("llama")
    bias = _bias(k_rot="rotate" in levers, pre_rope="pre_rope" in levers)
    cfg = kvslim.parse_spec(spec + levers)
    cache = SlimCache.from_config(cfg, config=model.config, mean_center=bias)
    shape = ModelShape.from_config(model.config, torch.float32)
    _logits(model, cache, _ids(length=40, seed=13), prefill=20)
    want = cache_bytes(shape, cfg.replace(mean_center="<tensors>"), 40, prefill=20)
    assert want == (cache.stored_tokens(), cache.live_nbytes())


def test_spec_keys_and_validation():
    c = kvslim.parse_spec("int2,rotate=kv,pre_rope=1")
    assert (c.rotate, c.pre_rope) == ("kv", True)
    assert kvslim.parse_spec(c.to_spec()) == c
    assert kvslim.parse_spec("int2,pre_rope=false").pre_rope is False
    auto = kvslim.parse_spec("int2")
    assert (auto.rotate, auto.pre_rope) == ("auto", "auto") and auto.to_spec() == "int2"
    assert kvslim.parse_spec("int2,pre_rope=auto,rotate=none").to_spec() == "int2,rotate=none"
    with pytest.raises(ValueError, match="rotate must be one of auto, none, k, v, kv"):
        kvslim.parse_spec("int2,rotate=q")
    with pytest.raises(ValueError, match="pre_rope must be 1, 0 or auto"):
        kvslim.parse_spec("int2,pre_rope=maybe")
    with pytest.raises(ValueError, match="pre_rope must be True, False or 'auto'"):
        SlimCache(pre_rope="yes")


def test_auto_levers_follow_the_format_and_the_bias_file():
    """The defaults (docs/quality.md "Low-bit levers"): every quantized tensor rotated, pre-RoPE keys for
    2-bit K; K's basis as a bias file records it; nothing without a config."""
    model = tiny_model("llama")

    def chosen(**kw):
        c = SlimCache(config=model.config, **kw)
        assert (c.report()["rotate"], c.report()["pre_rope"]) == (c.rotate, c.pre_rope)
        return c.rotate, c.pre_rope

    assert chosen(kv_quantize="int2") == ("kv", True)
    assert chosen(kv_quantize="int4") == ("kv", False)
    assert chosen(kv_quantize="int8", k_quantize="int2") == ("kv", True)
    assert chosen(kv_quantize="q4_0") == ("kv", False)
    assert chosen(kv_quantize="none") == ("none", False)
    assert chosen(kv_quantize="none", k_quantize="q4_0") == ("k", False)
    assert chosen(kv_quantize="int2", rotate="none", pre_rope=False) == ("none", False)
    assert chosen(kv_quantize="q4_0", mean_center=_bias()) == ("v", False)  # the file: K unrotated, post-RoPE
    assert chosen(kv_quantize="q4_0", mean_center=_bias(k_rot=True, pre_rope=True)) == ("kv", True)
    c = SlimCache(kv_quantize="int2")
    assert (c.rotate, c.pre_rope) == ("none", False)
    odd = tiny_model("llama", hidden_size=96, num_attention_heads=4, num_key_value_heads=2)  # head_dim 24
    assert (SlimCache(kv_quantize="int4", config=odd.config).rotate) == "none"


def test_sample_flags_reach_the_cache():
    import argparse

    from kvslim.cli.common import add_cache_flags, cache_config_from_args

    p = argparse.ArgumentParser()
    add_cache_flags(p)
    cfg = cache_config_from_args(p.parse_args(["--kv-quantize", "int2", "--kv-rotate", "v", "--kv-pre-rope"]))
    assert (cfg.rotate, cfg.pre_rope) == ("v", True)
    assert cache_config_from_args(p.parse_args(["--kv-pre-rope", "off"])).pre_rope is False
    default = cache_config_from_args(p.parse_args([]))
    assert (default.rotate, default.pre_rope) == ("auto", "auto")


def test_auto_rotation_leaves_16_bit_storage_alone():
    """fp16/bf16 storage is a cast: rotating it adds rounding (a bf16 cache of a bf16 model is exact) and can
    overflow fp16 (a rotation grows a value by up to sqrt(block)). fp8 and the integer formats are rotated."""
    model = tiny_model("llama")
    assert {f: SlimCache(kv_quantize=f, config=model.config).rotate for f in ("fp16", "bf16", "fp8", "int4", "q4_0")} == {
        "fp16": "none", "bf16": "none", "fp8": "kv", "int4": "kv", "q4_0": "kv"
    }
    cache = SlimCache(kv_quantize="fp16", residual=0, group_size=1, config=model.config)
    k = torch.full((1, 2, 4, 32), 20000.0)
    cache.update(k, k.clone(), 0)  # fits fp16 unrotated (a rotated 20000 * sqrt(32) would not)
    keys, _ = cache.stores()[0].read(torch.float32)
    assert torch.equal(keys, k)


def test_encoded_tokens_are_not_rounded_to_the_residual_dtype_first():
    """residual_dtype 'auto' (float16 for an fp32 model) applies to what stays at full precision only: a value
    beyond float16's range that goes straight to the encoder is stored, not refused."""
    model = tiny_model("llama")
    k = torch.randn(1, 2, 8, 32)
    k[..., 0] = 1e5
    cache = SlimCache(kv_quantize="q8_0", residual=0, group_size=1, sink=0, config=model.config)
    cache.update(k, k.clone(), 0)
    keys, _ = cache.stores()[0].read(torch.float32)
    torch.testing.assert_close(keys, k, atol=1e5 / 127, rtol=0)
