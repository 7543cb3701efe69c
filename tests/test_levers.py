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
import kvslim.cache as cache_mod
from conftest import tiny_config, tiny_model
from kvslim import SlimCache
from kvslim.biasfile import write_bias_file
from kvslim.formats.floats import NoneFormat
from kvslim.generate import forward
from kvslim.hadamard import MIN_BLOCK, Hadamard, block_size, sylvester
from kvslim.meancenter import BiasSet

ROTATE = ["none", "k", "v", "kv"]


class ExactFormat(NoneFormat):
    """Stores the tokens as given, but flagged lossy: a body, a residual, the kernels' cast path."""

    lossy = True


@pytest.fixture
def exact_codecs(monkeypatch):
    """SlimCache builds its codecs with an exact lossy one (whatever the format name says)."""
    monkeypatch.setattr(cache_mod, "make_codec", lambda name, role, **kw: ExactFormat().codec(role))


def _ids(batch=1, length=30, seed=0):
    return torch.randint(3, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


def _left_pad(ids: torch.Tensor, pads: list[int]):
    rows, masks = [], []
    for b, p in enumerate(pads):
        rows.append(torch.cat([torch.zeros(p, dtype=torch.long), ids[b, : ids.shape[1] - p]]))
        masks.append(torch.cat([torch.zeros(p, dtype=torch.long), torch.ones(ids.shape[1] - p, dtype=torch.long)]))
    return torch.stack(rows), torch.stack(masks)


def _logits(model, cache, ids, mask=None, prefill=9, chunk=1):
    """Logits (B, T, V) of a prefill, then ``chunk`` tokens per forward (explicit pads and positions)."""
    pads = None if mask is None else (mask == 0).sum(1)
    out = []
    with torch.no_grad():
        for s, e in [(0, prefill)] + [(t, min(t + chunk, ids.shape[1])) for t in range(prefill, ids.shape[1], chunk)]:
            m = None if mask is None else mask[:, :e]
            out.append(forward(model, ids[:, s:e], cache, pads=pads, attention_mask=m, logits_to_keep=0))
    return torch.cat(out, dim=1)


# -- the matrix ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [16, 32, 64, 128, 256, 512])
def test_hadamard_is_orthonormal_and_its_own_inverse(n):
    h = Hadamard(n, n).matrix()  # float32, as applied
    eye = torch.eye(n)
    torch.testing.assert_close(h @ h, eye, atol=2e-6, rtol=0)  # its own inverse to fp32 rounding
    torch.testing.assert_close(h @ h.T, eye, atol=2e-6, rtol=0)  # orthonormal
    assert torch.equal(h, h.T)
    # an independent definition: H[i, j] = (-1)^popcount(i & j) / sqrt(n)
    i = torch.arange(n)
    sign = torch.tensor([[(-1) ** bin(a & b).count("1") for b in range(n)] for a in range(n)], dtype=torch.float64)
    torch.testing.assert_close(sylvester(n), sign / n**0.5, atol=1e-15, rtol=0)
    x = torch.randn(3, 5, n, generator=torch.Generator().manual_seed(n))
    torch.testing.assert_close(Hadamard(n, n).apply(Hadamard(n, n).apply(x)), x, atol=5e-6, rtol=0)
    assert i.numel() == n


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
        kv_quantize="q4_0", residual=residual, group_size=group, rotate=rotate, pre_rope=pre_rope, config=model.config
    )
    assert cache.compressed_attention == (attn == "kvslim")
    got = _logits(model, cache, ids, mask)
    assert cache.stores()[0].k.n_body > 0  # tokens really went through the encoded body
    keep = mask.bool()
    torch.testing.assert_close(got[keep], ref[keep], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("attn", ["sdpa", "kvslim"])
@pytest.mark.parametrize("rotate, pre_rope", [("kv", False), ("none", True), ("kv", True)])
@pytest.mark.parametrize("positions", ["original", "cache"])
def test_levers_compose_with_streaming_and_rebasing(exact_codecs, rotate, pre_rope, attn, positions):
    """Sinks + window far past the window, re-based position ids: the levers change nothing."""
    model = tiny_model("llama", attn_implementation=attn)
    ids = _ids(length=70, seed=2)
    kw = dict(kv_quantize="q4_0", residual=4, group_size=2, sink=2, window=9, positions=positions, config=model.config)
    plain = SlimCache(**kw)
    plain.rebase_period = 16
    levers = SlimCache(rotate=rotate, pre_rope=pre_rope, **kw)
    levers.rebase_period = 16
    a = _logits(model, plain, ids, chunk=3)
    b = _logits(model, levers, ids, chunk=3)
    torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("attn", ["sdpa", "kvslim"])
@pytest.mark.parametrize("rotate, pre_rope", [("none", False), ("k", False), ("none", True), ("kv", True)])
def test_centering_in_any_basis_is_exact(exact_codecs, rotate, pre_rope, attn):
    """A bias (any values) in the stored basis is subtracted on encode and added back on read: the plain
    cache's logits, whatever else is kept at full precision (sinks, residual) — no softmax invariance."""
    model = tiny_model("llama", attn_implementation=attn)
    ids, mask = _left_pad(_ids(batch=2, length=24, seed=3), [0, 3])
    ref = _logits(model, DynamicCache(config=model.config), ids, mask)
    g = torch.Generator().manual_seed(4)
    bias = BiasSet([torch.randn(2, 32, generator=g) * 5 for _ in range(2)], k_rot=rotate != "none", pre_rope=pre_rope)
    cache = SlimCache(
        kv_quantize="q4_0", residual=4, group_size=2, rotate=rotate, pre_rope=pre_rope, mean_center=bias,
        config=model.config,
    )  # fmt: skip
    got = _logits(model, cache, ids, mask)
    keep = mask.bool()
    torch.testing.assert_close(got[keep], ref[keep], atol=1e-5, rtol=1e-5)


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


@pytest.mark.parametrize("rope", ["default", "linear", "llama3", "yarn"])
def test_pre_rope_decode_matches_for_static_ropes(exact_codecs, rope):
    model = tiny_model("llama", max_position_embeddings=16, rope_parameters=ROPES[rope])
    kvslim.enable(model)
    ids = _ids(length=30, seed=6)
    a = _logits(model, DynamicCache(config=model.config), ids)
    b = _logits(model, SlimCache(kv_quantize="q4_0", residual=4, group_size=2, pre_rope=True, config=model.config), ids)
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
    with pytest.raises(ValueError, match="pre_rope=True supports RoPE types default, linear, dynamic, llama3, yarn"):
        SlimCache(kv_quantize="int4", pre_rope=True, config=cfg)
    with pytest.raises(ValueError, match="pre_rope=True needs config"):
        SlimCache(kv_quantize="int4", pre_rope=True)


# -- bias files in a basis ---------------------------------------------------------------------------------


def _bias(k_rot=False, pre_rope=False, scale=0.5):
    g = torch.Generator().manual_seed(7)
    return BiasSet([torch.randn(2, 32, generator=g) * scale for _ in range(2)], k_rot=k_rot, pre_rope=pre_rope)


@pytest.mark.parametrize(
    "file_rot, file_pre, rotate, pre_rope, match",
    [
        (False, False, "k", False, r"unrotated \(k_rot=false\) K basis, but this cache stores K rotated"),
        (True, False, "none", False, r"rotated \(k_rot=true\) K basis, but this cache stores K unrotated"),
        (True, False, "v", False, "k_rot"),  # rotating V alone leaves K unrotated
        (False, False, "none", True, r"post-RoPE \(no k_pre_rope\) K basis, but this cache stores K pre-RoPE"),
        (False, True, "none", False, r"pre-RoPE \(k_pre_rope=true\) K basis, but this cache stores K post-RoPE"),
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
    from kvslim.calibrate import collect_k_means_from_ids
    from kvslim.formats import quantize_ggml  # noqa: F401  (the q4_0 format the bias is for)

    model = tiny_model("llama")
    ids = _ids(length=96, seed=8)[0]
    kw = dict(ctx=48, progress=False, fingerprint="sha256:" + "ab" * 32)
    with pytest.warns(UserWarning, match="noisy estimate"):
        plain = collect_k_means_from_ids(model, ids, **kw)
        rot = collect_k_means_from_ids(model, ids, rotate=True, **kw)
        pre = collect_k_means_from_ids(model, ids, pre_rope=True, **kw)
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
    unrot = torch.cat([rot0.move(first, -pos[None].expand(1, -1)), rot0.move(second, -pos[None].expand(1, -1))], 2)
    torch.testing.assert_close(pre.tensors[0], unrot.double().mean(dim=(0, 2)).float(), atol=1e-5, rtol=1e-5)
    path = tmp_path / "rot.gguf"
    write_bias_file(path, rot)
    from kvslim.biasfile import read_bias_file

    back = read_bias_file(path)
    assert back.k_rot is True and back.pre_rope is False
    write_bias_file(tmp_path / "both.gguf", both)
    assert read_bias_file(tmp_path / "both.gguf").pre_rope is True
    SlimCache(kv_quantize="q4_0", rotate="k", mean_center=path, config=model.config)


def test_calibrate_cli_records_the_basis(tmp_path):
    """``kvslim calibrate --kv-rotate k --kv-pre-rope`` on a tiny model saved to disk writes both keys."""
    from gguf import GGUFReader

    from kvslim.cli import main

    model = tiny_model("llama")
    model_dir = tmp_path / "m"
    model.save_pretrained(model_dir)
    text = tmp_path / "t.txt"
    text.write_text("x")
    if not _tokenizer_for(model_dir):
        pytest.skip("no tokenizer can be saved offline here")
    out = tmp_path / "b.gguf"
    # a 1-character text: calibrate says on stderr how many tokens a useful bias needs, and still writes
    rc = main(["calibrate", "--model", str(model_dir), "--text", str(text), "--kv-rotate", "k", "--kv-pre-rope",
               "--out", str(out), "--no-progress"])  # fmt: skip
    assert rc == 0
    r = GGUFReader(out)
    assert bool(r.get_field("kv_mean_center.k_rot").contents()) is True
    assert bool(r.get_field("kv_mean_center.k_pre_rope").contents()) is True


def _tokenizer_for(model_dir) -> bool:
    try:
        from kvslim.models import load_model

        _, tok = load_model(None)
    except Exception:  # noqa: BLE001
        return False
    tok.save_pretrained(model_dir)
    return True


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
        fork[il] = np.einsum("ij,htj->hti", hm.astype(np.float64), llama_k).mean(axis=1).astype(np.float32)  # H P k
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
        torch.testing.assert_close(cache._biases[il], want[il], atol=1e-5, rtol=1e-5)
    # and kvslim's own writer round-trips through llama.cpp's order
    from kvslim.biasfile import from_llama_cpp_order, to_llama_cpp_order

    ours = BiasSet([t.clone() for t in want], k_rot=True)
    there = to_llama_cpp_order(ours, "llama")
    for il in range(2):
        torch.testing.assert_close(there.tensors[il], torch.from_numpy(fork[il]), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(from_llama_cpp_order(there, "llama").tensors[il], want[il], atol=1e-5, rtol=1e-5)
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
    from kvslim.formats import make_codec
    from kvslim.rotary import Rotary

    g = torch.Generator().manual_seed(10)
    b, h, t, d, m = 2, 3, 77, 64, 5
    codec = make_codec(fmt, "k", group_size=8)
    x = torch.randn(b, h, t - t % codec.token_group + codec.token_group, d, generator=g) * 2
    enc = codec.encode(x)
    offset = 3 if codec.token_group > 1 else 0
    enc, offset = enc.narrow(offset, x.shape[2] - 2, 0, codec.token_group) if codec.token_group > 1 else (enc, 0)
    n = next(iter(enc.token.values())).shape[2]
    q = torch.randn(b, h, m, d, generator=g)
    bias = torch.randn(h, d, generator=g) if centered else None
    had = Hadamard.for_head_dim(d) if rotated else None
    rot = Rotary(1.0 / 10000 ** (torch.arange(0, 48, 2).float() / 48), offset=8)  # partial rotary after 8 channels
    pos = torch.arange(n)[None, :] + torch.tensor([[100], [7]])  # (B, n): per-row positions
    cos, sin = rot.table(pos, "cpu")
    tr = kernels.KeyTransform(bias=bias, hadamard=had, cos=cos, sin=sin, rope_offset=8)
    kernels.set_backend(backend)
    try:
        got = kernels.k_scores(q, codec, enc, offset, tr)
    finally:
        kernels.set_backend(None)
    keys = codec.decode(enc, torch.float64, offset)
    if bias is not None:
        keys = keys + bias.double()[None, :, None, :]
    if had is not None:
        keys = keys @ had.matrix(dtype=torch.float64)
    keys = rot.move(keys.float(), pos).double()
    want = q.double() @ keys.transpose(-1, -2)
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4)


# -- bytes, config, CLI ----------------------------------------------------------------------------------


def test_nbytes_count_the_rotation_and_angle_tables():
    model = tiny_model("llama")
    kvslim.enable(model)
    cache = SlimCache(kv_quantize="int4", residual=0, group_size=4, rotate="kv", pre_rope=True, config=model.config)
    _logits(model, cache, _ids(length=20, seed=11), prefill=8)
    comp = cache.components()
    assert comp["hadamard"] == 4 * 32 * 32  # one float32 H_32, shared by K, V and every layer
    assert comp["rotary"] > 16 * 4  # the frequencies and the last angle table
    assert cache.nbytes() == sum(comp.values())


def test_spec_keys_and_validation():
    c = kvslim.parse_spec("int2,rotate=kv,pre_rope=1")
    assert (c.rotate, c.pre_rope, c.rotate_k, c.rotate_v) == ("kv", True, True, True)
    assert kvslim.parse_spec(c.to_spec()) == c
    assert kvslim.parse_spec("int2,pre_rope=false").pre_rope is False
    with pytest.raises(ValueError, match="rotate must be one of none, k, v, kv"):
        kvslim.parse_spec("int2,rotate=q")
    with pytest.raises(ValueError, match="pre_rope must be 1 or 0"):
        kvslim.parse_spec("int2,pre_rope=maybe")
    with pytest.raises(ValueError, match="pre_rope must be True or False"):
        SlimCache(pre_rope="yes")


def test_sample_flags_reach_the_cache():
    import argparse

    from kvslim.cli.common import add_cache_flags, cache_config_from_args

    p = argparse.ArgumentParser()
    add_cache_flags(p)
    cfg = cache_config_from_args(p.parse_args(["--kv-quantize", "int2", "--kv-rotate", "v", "--kv-pre-rope"]))
    assert (cfg.rotate, cfg.pre_rope) == ("v", True)
    assert cache_config_from_args(p.parse_args([])).rotate == "none"
