"""kvslim.vllm.basis: Hadamard-rotated pages inside vLLM's backend, without vLLM.

Which roles a spec rotates on which page layout; a rotated page holds byte for byte what kvslim's own cache encodes
for the same K/V; attention over rotated pages (queries rotated, output rotated back) is attention over the
unrotated values; and on K/V with outlier channels, rotated q4_0 pages attend closer to the exact values."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvslim.config import parse_spec
from kvslim.vllm import attend as paged
from kvslim.vllm import basis as vb
from kvslim.vllm.basis import PageBasis
from kvslim.vllm.pages import PAGE_TOKENS, PageLayout, write
from kvslim.vllm.spec import from_sources

T = PAGE_TOKENS


def _basis(spec: str, d: int = 64) -> PageBasis:
    config = parse_spec(spec)
    return PageBasis.of(config, PageLayout.of(config.k_format, config.v_format, d, torch.float32))


@pytest.mark.parametrize(
    "spec,rotated",
    [
        ("q4_0", "kv" if vb.AUTO else "none"),
        ("none", "none"),
        ("fp16", "none"),
        ("q8_0,v=fp16", "k" if vb.AUTO else "none"),
        ("q4_0,rotate=none", "none"),
        ("q4_0,rotate=k", "k"),
        ("int8,v=int4,rotate=v", "v"),
        ("q8_0,v=fp16,rotate=k", "k"),
    ],
)
def test_which_roles_are_rotated(spec, rotated):
    assert _basis(spec).name == rotated


def test_auto_leaves_a_head_dim_without_a_hadamard_block_alone_and_explicit_rotation_refuses_it():
    assert _basis("int8", d=40).name == "none"  # 40 = 8 x 5: blocks of 8, below Hadamard's minimum
    with pytest.raises(
        ValueError, match=r"^kvslim: rotate='kv': a Hadamard rotation needs a head_dim divisible"
    ):
        _basis("int8,rotate=kv", d=40)


@pytest.mark.parametrize("spec,words", [("q8_0,v=fp16,rotate=kv", "V (fp16)"), ("none,rotate=k", "K (none)")])
def test_rotating_plain_values_is_refused_in_one_line(spec, words):
    with pytest.raises(ValueError) as e:
        _basis(spec)
    text = str(e.value)
    assert (
        text.startswith("kvslim: rotate=") and words in text and "only encoded" in text and "\n" not in text
    )


def test_a_hadamard_rotation_is_taken_and_a_fitted_one_refused():
    assert from_sources({"kvslim": "q4_0,rotate=kv"}, {}).rotate == "kv"
    with pytest.raises(ValueError, match=r"^kvslim: rotate='fitted' is not supported in vLLM"):
        PageBasis.of(
            SimpleNamespace(rotate="fitted", mean_center=None),
            PageLayout.of("q4_0", "q4_0", 64, torch.float32),
        )


def _kv(n: int, h: int, d: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V (n, h, d) with a few large outlier channels, as a model's keys have."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(n, h, d, generator=g)
    k[..., 3] *= 20
    k[..., 17] += 8
    v = torch.randn(n, h, d, generator=g)
    v[..., 5] *= 10
    return k, v


@pytest.mark.parametrize("fmt,roles", [("q4_0", "kv"), ("q8_0", "kv"), ("int4", "v")])
def test_a_rotated_page_holds_kvslims_own_rotated_codes(fmt, roles):
    """The pages' codes of rotated K/V are the bytes kvslim's own cache stores for the same K/V and rotation
    (every token encoded as it arrives: residual 0, group 1), where both encode per token: GGML blocks, per-token
    affine V (kvslim's own affine K is per channel, KIVI's: not a page's)."""
    import transformers as tf

    import kvslim

    h, d, n = 2, 64, 40
    cfg = tf.LlamaConfig(
        vocab_size=64, hidden_size=h * d, intermediate_size=32, num_hidden_layers=1, num_attention_heads=h,
        num_key_value_heads=h, head_dim=d,
    )  # fmt: skip
    k, v = _kv(n, h, d)
    cache = kvslim.SlimCache.from_config(
        parse_spec(f"{fmt},residual=0,group=1,sink=0,rotate=kv,pre_rope=0"), config=cfg
    )
    cache.update(k.transpose(0, 1)[None], v.transpose(0, 1)[None], 0)
    store = cache.layers[0].store
    layout = PageLayout.of(fmt, fmt, d, torch.float32)
    rot = _basis(f"{fmt},rotate=kv")
    pages = torch.zeros(-(-n // T), h, T, layout.row_bytes, dtype=torch.uint8)
    write(layout, pages, rot.keys(k), rot.values(v), torch.arange(n))
    rows = pages.transpose(0, 1).reshape(h, -1, layout.row_bytes)[:, :n]  # (H, n, row bytes)
    for role in roles:
        part, body = getattr(layout, role), getattr(store, role).body()
        mine = rows[..., part.offset : part.offset + part.nbytes]
        if part.family == "ggml":
            own = body.token["blocks"][0]
        else:  # per-token affine: codes, scale, zero
            parts = [body.token["codes"][0]] + [
                body.token[x][0].contiguous().view(torch.uint8) for x in ("scale", "zero")
            ]
            own = torch.cat(parts, -1)
        assert torch.equal(mine, own), (fmt, role)


def _pages(layout, basis, kv_lens, q_lens, h_q, h_kv, d=64, seed=0):
    """Pages holding every row's cached K/V in ``basis``, the queries, the rows and the step's raw K/V (also in the
    basis, as the backend hands them), plus the same K/V unrotated for the exact answer."""
    g = torch.Generator().manual_seed(seed)
    per_row = max(-(-n // T) for n in kv_lens)
    table = torch.randperm(len(kv_lens) * per_row, generator=g).to(torch.int32).view(len(kv_lens), per_row)
    pages = torch.zeros(len(kv_lens) * per_row, h_kv, T, layout.row_bytes, dtype=torch.uint8)
    ks, vs, new_k, new_v = [], [], [], []
    for r, (n, m) in enumerate(zip(kv_lens, q_lens, strict=True)):
        k, v = _kv(n, h_kv, d, seed=seed + r)
        pos = torch.arange(n - m)
        write(
            layout,
            pages,
            basis.keys(k[: n - m], 0),
            basis.values(v[: n - m]),
            table[r, pos // T].long() * T + pos % T,
        )
        ks.append(k)
        vs.append(v)
        new_k.append(k[n - m :])
        new_v.append(v[n - m :])
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    query = torch.randn(int(starts[-1]), h_q, d, generator=g)
    rows = paged.Rows.of(starts, torch.tensor(kv_lens, dtype=torch.int32), table)
    raw = (basis.keys(torch.cat(new_k), 0), basis.values(torch.cat(new_v)))
    return pages, query, rows, raw, (ks, vs)


def _exact(query, rows, ks, vs, scale):
    """Causal attention on the unrotated fp32 K/V, row by row."""
    out = torch.zeros(query.shape)
    for r, (k, v) in enumerate(zip(ks, vs, strict=True)):
        q0, q1 = rows.starts[r], rows.starts[r + 1]
        n, g = q1 - q0, query.shape[1] // k.shape[1]
        kk, vv = (x.transpose(0, 1).repeat_interleave(g, 0) for x in (k, v))  # (H_q, L, D)
        s = query[q0:q1].transpose(0, 1) @ kk.transpose(1, 2) * scale  # (H_q, n, L)
        keep = torch.arange(k.shape[0])[None, :] <= torch.arange(k.shape[0] - n, k.shape[0])[:, None]
        out[q0:q1] = (torch.softmax(s.masked_fill(~keep, float("-inf")), -1) @ vv).transpose(0, 1)
    return out


@pytest.mark.parametrize("reference", [False, True], ids=["kernel", "reference"])
@pytest.mark.parametrize("roles", ["k", "v", "kv"])
def test_attention_over_rotated_pages_is_attention_over_the_values(roles, reference, monkeypatch):
    """fp32 pages (lossless), rotated: decode rows and a prefill chunk give the unrotated answer (up to rounding);
    without rotating the queries (or the output back) they would not."""
    if reference:
        monkeypatch.setenv(paged.KERNEL_ENV, "reference")
    elif paged.library() is None:
        pytest.skip(f"C kernels unavailable: {paged.status()}")
    from kvslim.cache.hadamard import Hadamard

    had = Hadamard.for_head_dim(64)
    basis = PageBasis(had if "k" in roles else None, had if "v" in roles else None)
    layout = PageLayout.of("none", "none", 64, torch.float32)
    kv_lens, q_lens = [70, 33, 1, 100], [1, 1, 1, 37]
    pages, query, rows, (key, value), (ks, vs) = _pages(layout, basis, kv_lens, q_lens, 9, 3)
    out = torch.full(query.shape, float("nan"))
    vb.attend(basis, layout, pages, query, out, rows, 0.125, 0, True, key, value)
    exact = _exact(query, rows, ks, vs, 0.125)
    torch.testing.assert_close(out, exact, atol=2e-4, rtol=2e-4)
    wrong = torch.zeros(query.shape)  # the same pages read as if nothing were rotated
    paged.attend(layout, pages, query, wrong, rows, 0.125, 0, True, key, value)
    assert (wrong - exact).abs().max() > 1e-2


@pytest.mark.skipif(paged.library() is None, reason=f"C kernels unavailable: {paged.status()}")
@pytest.mark.parametrize("fmt", ["q4_0", "int4"])
def test_rotated_low_bit_pages_attend_closer_to_the_exact_values(fmt):
    """K/V with outlier channels in q4_0 / per-token int4 pages: the rotated pages' attention error is below the
    unrotated pages' (what the rotation is for)."""
    layout = PageLayout.of(fmt, fmt, 64, torch.float32)
    errors = {}
    for name in ("none", "kv"):
        basis = _basis(f"{fmt},rotate={name}")
        pages, query, rows, (key, value), (ks, vs) = _pages(
            layout, basis, [300, 257, 95], [1, 1, 1], 9, 3, seed=3
        )
        out = torch.zeros(query.shape)
        vb.attend(basis, layout, pages, query, out, rows, 0.125, 0, True, key, value)
        errors[name] = ((out - _exact(query, rows, ks, vs, 0.125)) ** 2).mean().item()
    assert errors["kv"] < 0.7 * errors["none"], errors


# ------------------------------------------------------------------ K mean-centering (mean_center=FILE)


def _bias_file(tmp_path, n_layers=2, h=3, d=64, k_rot=True, pre_rope=False, seed=0, name="b.gguf"):
    from kvslim.calibration.biasfile import write_bias_file
    from kvslim.calibration.biasset import BiasSet

    g = torch.Generator().manual_seed(seed)
    tensors = [torch.randn(h, d, generator=g) * 3 for _ in range(n_layers)]
    path = tmp_path / name
    write_bias_file(
        path,
        BiasSet(tensors, k_rot=k_rot, pre_rope=pre_rope, cache_type="q4_0", channel_order="transformers"),
    )
    return str(path), tensors


def _centered(spec, path, n_layers=2, h=3, d=64):
    config = parse_spec(f"{spec},mean_center={path}")
    layout = PageLayout.of(config.k_format, config.v_format, d, torch.float32)
    return PageBasis.of(config, layout, vb.ModelShape(n_layers, h, "llama"))


def test_a_centered_layer_stores_its_keys_minus_its_bias_in_the_files_basis(tmp_path):
    rot, tensors = _bias_file(tmp_path, k_rot=True)
    basis = _centered("q4_0", rot)
    assert basis.name == "kv" and len(basis.k_bias) == 2
    x = torch.randn(5, 3, 64)
    torch.testing.assert_close(basis.keys(x, 1), basis.k.apply(x) - tensors[1])
    assert torch.equal(basis.values(x), basis.v.apply(x))  # V is not centered
    plain, tensors = _bias_file(tmp_path, k_rot=False, name="plain.gguf")
    basis = _centered("q4_0", plain)
    assert basis.name == "v"  # rotate=auto: K as the file records it (unrotated), V rotated
    torch.testing.assert_close(basis.keys(x, 0), x - tensors[0])


@pytest.mark.parametrize(
    "make,spec,words",
    [
        (
            lambda p: _bias_file(p, k_rot=False)[0],
            "q4_0,rotate=kv",
            "k_rot=false",
        ),  # the file's basis is not K's
        (lambda p: _bias_file(p, pre_rope=True)[0], "q4_0", "before RoPE"),
        (lambda p: _bias_file(p, n_layers=3)[0], "q4_0", "layer"),
        (lambda p: str(p / "absent.gguf"), "q4_0", "absent.gguf"),
    ],
)
def test_a_bias_file_that_does_not_fit_is_refused_in_one_line(tmp_path, make, spec, words):
    with pytest.raises(ValueError) as e:
        _centered(spec, make(tmp_path))
    text = str(e.value)
    assert text.startswith("kvslim: ") and words in text and "\n" not in text, text


def test_a_ranks_share_of_the_heads_is_refused(tmp_path):
    path, _ = _bias_file(tmp_path)
    basis = _centered("q4_0", path)
    with pytest.raises(ValueError, match="tensor-parallel"):
        basis.keys(torch.randn(4, 1, 64), 0)  # one of three KV heads
    with pytest.raises(ValueError, match="no K bias for layer 2"):
        basis.keys(torch.randn(4, 3, 64), 2)


@pytest.mark.parametrize("reference", [False, True], ids=["kernel", "reference"])
def test_attention_over_centered_pages_is_attention_over_the_keys(tmp_path, reference, monkeypatch):
    """Every key centered alike (the pages' and the step's raw ones): each query's scores move by q . bias, which the
    softmax ignores; fp32 pages, decode rows and a prefill chunk."""
    if reference:
        monkeypatch.setenv(paged.KERNEL_ENV, "reference")
    elif paged.library() is None:
        pytest.skip(f"C kernels unavailable: {paged.status()}")
    path, tensors = _bias_file(tmp_path, n_layers=1, k_rot=False)
    basis = PageBasis(k_bias=(tensors[0] * 5,))  # large, so that forgetting one side would show
    layout = PageLayout.of("none", "none", 64, torch.float32)
    kv_lens, q_lens = [70, 33, 1, 100], [1, 1, 1, 37]
    pages, query, rows, (key, value), (ks, vs) = _pages(layout, basis, kv_lens, q_lens, 9, 3)
    out = torch.full(query.shape, float("nan"))
    vb.attend(basis, layout, pages, query, out, rows, 0.125, 0, True, key, value)
    torch.testing.assert_close(out, _exact(query, rows, ks, vs, 0.125), atol=2e-4, rtol=2e-4)
    uncentered_raw = PageBasis()  # the step's own keys left uncentered: no longer one shift for every key
    wrong = torch.zeros(query.shape)
    raw_k = torch.cat([k[n - m :] for k, n, m in zip(ks, kv_lens, q_lens, strict=True)])
    vb.attend(uncentered_raw, layout, pages, query, wrong, rows, 0.125, 0, True, raw_k, value)
    assert (wrong - _exact(query, rows, ks, vs, 0.125)).abs().max() > 1e-2


@pytest.mark.skipif(paged.library() is None, reason=f"C kernels unavailable: {paged.status()}")
@pytest.mark.parametrize("roles", ["k", "v", "kv", "none"])
def test_a_steps_kv_rotated_in_one_call_are_hadamard_applys_bits(roles):
    """``PageBasis.stored``: the step's K and V through one C call are bit for bit ``keys``/``values`` (Hadamard.apply
    through kvslim's linear kernel), read in place from transformers' (1, H, N, D) layout, with the largest
    magnitude of both (NaN if any); with a K bias they are rotated in torch (no magnitude); with no rotation they are
    the tensors given."""
    from kvslim.cache.hadamard import Hadamard
    from kvslim.kernels import linear

    if not linear.ready():
        pytest.skip("kvslim's linear kernel is not built here")
    had = Hadamard.for_head_dim(64)
    basis = PageBasis(had if "k" in roles else None, had if "v" in roles else None)
    g = torch.Generator().manual_seed(3)
    kv = torch.randn(2, 1, 3, 17, 64, generator=g) * 50
    key, value = kv[0, 0].transpose(0, 1), kv[1, 0].transpose(0, 1)  # (N, H, D) views, as the attention gets them
    keys, values, largest = basis.stored(key, value, 0)
    assert torch.equal(keys, basis.keys(key, 0)) and torch.equal(values, basis.values(value))
    if roles == "none":  # nothing to rotate: as given, no call
        assert keys is key and values is value and largest is None
        return
    assert largest == max(keys.abs().max().item(), values.abs().max().item())
    value[16, 2, 63] = float("nan")
    assert basis.stored(key, value, 0)[2] != basis.stored(key, value, 0)[2]  # NaN
    biased = PageBasis(basis.k, basis.v, (torch.zeros(3, 64),))
    keys_b, values_b, none = biased.stored(key, value, 0)
    assert none is None and torch.equal(keys_b, biased.keys(key, 0))
