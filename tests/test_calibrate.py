"""K mean-centering: calibration (kvslim.calibration.calibrate), the bias file (kvslim.calibration.biasfile), loading for a
cache (kvslim.calibration.meancenter), `kvslim calibrate`."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch
from gguf import GGUFWriter

from conftest import tiny_model
from kvslim.calibration.biasfile import read_bias_file, write_bias_file
from kvslim.calibration.calibrate import chunk_spans, collect_k_means, collect_k_means_from_ids
from kvslim.calibration.channelorder import from_llama_cpp_order, to_llama_cpp_order
from kvslim.calibration.meancenter import BiasSet, load_mean_center
from kvslim.cli import main
from kvslim.models import model_fingerprint

H, D, L = 2, 32, 2  # tiny_model: 2 layers, 2 KV heads, head_dim 32
FP = "sha256:" + "ab" * 32

# The tiny texts here are far below a useful calibration (test_few_tokens_warn checks the warning).
pytestmark = pytest.mark.filterwarnings("ignore:calibrating on .* tokens:UserWarning")


def sha256(path) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def ids():
    g = torch.Generator().manual_seed(1)
    return torch.randint(3, 128, (300,), generator=g)


@pytest.fixture(scope="module")
def bias(model, ids):
    return collect_k_means_from_ids(model, ids, ctx=128, progress=False, rotate=False)  # the post-RoPE keys as given


def random_bias(seed=0, **meta) -> BiasSet:
    g = torch.Generator().manual_seed(seed)
    meta = {
        "model_fingerprint": FP,
        "cache_type": "q4_0",
        "n_tokens": 1024,
        "ctx": 512,
        "n_chunks": 2,
        **meta,
    }
    return BiasSet(tensors=[torch.randn(H, D, generator=g) for _ in range(L)], text_sha256="cd" * 32, **meta)


def write_fork_file(
    path, tensors, *, general_type="kv-mean-center", k_rot=False, extra=None, dtype=np.float32
):
    """A bias file in the fork's own layout (common/kv-mean-center.cpp), written with gguf-py alone:
    only the fork's keys, 1-D F32 tensors of n_embd_head * n_head_kv values, channel fastest."""
    w = GGUFWriter(str(path), arch="")  # the fork's files carry no general.architecture
    w.add_string("general.type", general_type)
    w.add_uint32("kv_mean_center.schema_version", 1)
    w.add_string("kv_mean_center.model_sha256", "0123456789abcdef" * 4)  # the fork's GGUF-file hash
    w.add_bool("kv_mean_center.k_rot", k_rot)
    for key, (kind, value) in (extra or {}).items():
        getattr(w, f"add_{kind}")(key, value)
    for il, t in tensors.items():
        w.add_tensor(f"kv_bar.blk.{il}.k", np.ascontiguousarray(np.asarray(t, dtype=dtype).reshape(-1)))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def load(value, **kw):
    """load_mean_center for tiny_model's shapes and architecture (llama: a file in llama.cpp's
    channel order, as every fork file is, is converted)."""
    kw.setdefault("model_type", "llama")
    return load_mean_center(value, n_layers=L, n_kv_heads=H, head_dim=D, **kw)


# -- collection ------------------------------------------------------------------------------


def test_collector_means_equal_direct_computation(model, ids, bias):
    from transformers import DynamicCache

    sums = [torch.zeros(H, D, dtype=torch.float64) for _ in range(L)]
    for start in (0, 128):  # 300 tokens at ctx 128: two full chunks, the 44-token tail dropped
        cache = DynamicCache()
        with torch.no_grad():
            model(input_ids=ids[start : start + 128][None], cache=cache, use_cache=True)
        for il in range(L):
            keys = cache.layers[il].keys  # (1, H, 128, D), post-RoPE
            sums[il] += keys.double().sum(dim=(0, 2))
    for il in range(L):
        torch.testing.assert_close(bias.tensors[il].double(), sums[il] / 256, atol=1e-6, rtol=0)
        assert bias.tensors[il].dtype == torch.float32 and bias.tensors[il].shape == (H, D)
    assert (bias.n_tokens, bias.n_chunks, bias.ctx, bias.k_rot) == (256, 2, 128, False)
    assert bias.model_fingerprint == model_fingerprint(model)
    assert all(0 < r["ratio"] < 1 for r in bias.summary_rows())


def test_chunk_spans():
    assert chunk_spans(300, 128) == [(0, 128), (128, 256)]  # partial tail dropped
    assert chunk_spans(100, 128) == [(0, 100)]  # shorter than ctx: used whole
    assert chunk_spans(1000, 128, chunks=3) == [(0, 128), (128, 256), (256, 384)]
    assert chunk_spans(1000, 128, max_tokens=300) == [(0, 128), (128, 256)]
    assert chunk_spans(1000, 512, max_tokens=100) == [(0, 100)]
    for bad in (dict(ctx=0), dict(ctx=128, chunks=0), dict(ctx=128, max_tokens=-1)):
        with pytest.raises(ValueError, match="positive integer"):
            chunk_spans(1000, **bad)
    with pytest.raises(ValueError, match="no tokens"):
        chunk_spans(0, 128)


def test_text_entry_point_and_deterministic_runs(model, tmp_path):
    class CharTokenizer:  # a stand-in: one token per character
        def __call__(self, text):
            return {"input_ids": [3 + ord(c) % 120 for c in text]}

    text = "the quick brown fox jumps over the lazy dog. " * 8
    paths = []
    for run in range(2):
        b = collect_k_means(model, CharTokenizer(), text, ctx=64, chunks=3, progress=False, cache_type="q8_0")
        paths.append(tmp_path / f"run{run}.gguf")
        write_bias_file(paths[-1], b)
    assert sha256(paths[0]) == sha256(paths[1])
    assert b.text_sha256 == hashlib.sha256(text.encode()).hexdigest()
    assert (b.n_tokens, b.n_chunks, b.cache_type) == (192, 3, "q8_0")


def test_bad_input_ids(model):
    with pytest.raises(ValueError, match="one sequence"):
        collect_k_means_from_ids(model, torch.zeros(2, 10, dtype=torch.long), progress=False)
    with pytest.raises(ValueError, match="integer token ids"):
        collect_k_means_from_ids(model, torch.zeros(10), progress=False)


# -- file ------------------------------------------------------------------------------------


def test_round_trip_and_deterministic_bytes(tmp_path, bias):
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    write_bias_file(a, bias)
    write_bias_file(b, bias)
    assert sha256(a) == sha256(b)
    back = read_bias_file(a)
    assert back.metadata() == bias.metadata()
    assert len(back.tensors) == L
    for t0, t1 in zip(bias.tensors, back.tensors, strict=True):
        assert t1.shape == (H, D) and torch.equal(t0, t1)


def test_file_layout(tmp_path):
    from gguf import GGUFReader

    path = tmp_path / "b.gguf"
    write_bias_file(path, random_bias())
    r = GGUFReader(path)
    keys = [k for k in r.fields if not k.startswith("GGUF.")]
    assert keys[:4] == [
        "general.type",
        "kv_mean_center.schema_version",
        "kv_mean_center.model_sha256",
        "kv_mean_center.k_rot",
    ]
    assert "general.architecture" not in keys
    assert r.get_field("kv_mean_center.model_sha256").contents() == "ab" * 32  # bare hex, as the fork
    assert r.get_field("kv_mean_center.schema_version").types[0].name == "UINT32"
    assert r.get_field("kv_mean_center.n_tokens").types[0].name == "UINT64"
    assert [t.name for t in r.tensors] == ["kv_bar.blk.0.k", "kv_bar.blk.1.k"]
    assert [list(map(int, t.shape)) for t in r.tensors] == [[D, H], [D, H]]  # GGUF ne order


def test_fork_layout_file_loads_like_ours(tmp_path):
    ours = random_bias(model_fingerprint=None)
    write_bias_file(tmp_path / "ours.gguf", ours)
    # A NEOX-RoPE arch (qwen2): llama.cpp's channel order is transformers'; the fork's file is used as is.
    write_fork_file(tmp_path / "fork.gguf", {il: t.numpy() for il, t in enumerate(ours.tensors)})
    a, b = load(tmp_path / "ours.gguf"), load(str(tmp_path / "fork.gguf"), model_type="qwen2")
    for ta, tb, t0 in zip(a, b, ours.tensors, strict=True):
        assert ta.shape == tb.shape == (H, D)
        assert torch.equal(ta, tb) and torch.equal(ta, t0)
    # The fork's model_sha256 hashes its GGUF file, not kvslim's fingerprint: never compared.
    back = read_bias_file(tmp_path / "fork.gguf")
    assert back.model_fingerprint is None and back.cache_type is None
    assert back.tensors[0].shape == (H * D,)
    assert read_bias_file(tmp_path / "fork.gguf", n_kv_heads=H, head_dim=D).tensors[0].shape == (H, D)
    load(tmp_path / "fork.gguf", model_fingerprint=FP)


def test_fork_file_without_schema_version(tmp_path):
    path = tmp_path / "old.gguf"
    w = GGUFWriter(str(path), arch="")
    w.add_string("general.type", "kv-mean-center")
    w.add_bool("kv_mean_center.k_rot", False)
    for il in range(L):
        w.add_tensor(f"kv_bar.blk.{il}.k", np.full(H * D, il, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert [float(t[0, 0]) for t in load(path)] == [0.0, 1.0]


# -- validation ------------------------------------------------------------------------------


def test_tensor_shapes_accepted():
    b = random_bias()
    flat = [t.reshape(-1) for t in b.tensors]
    for value in (b, b.tensors, flat, [t.numpy() for t in flat], [t.double() for t in b.tensors]):
        out = load(value)
        assert all(torch.equal(o, t) for o, t in zip(out, b.tensors, strict=True))
    assert load(b, dtype=torch.float16)[0].dtype == torch.float16


def test_missing_and_extra_layers(tmp_path):
    t = np.zeros((H, D), np.float32)
    write_fork_file(tmp_path / "short.gguf", {0: t})
    with pytest.raises(ValueError, match=r"kv_bar\.blk\.1\.k missing; .* has 1 layers, the model has 2"):
        load(tmp_path / "short.gguf")
    write_fork_file(tmp_path / "long.gguf", {0: t, 1: t, 2: t})
    with pytest.raises(ValueError, match=r"kv_bar\.blk\.2\.k present .* the model has 2 layers"):
        load(tmp_path / "long.gguf")
    write_fork_file(tmp_path / "gap.gguf", {0: t, 2: t})
    with pytest.raises(ValueError, match=r"kv_bar\.blk\.1\.k missing"):
        read_bias_file(tmp_path / "gap.gguf")


def test_wrong_element_count_shape_and_dtype(tmp_path):
    write_fork_file(tmp_path / "n.gguf", {0: np.zeros(H * D), 1: np.zeros(H * D - 1)})
    with pytest.raises(
        ValueError, match=r"kv_bar\.blk\.1\.k .*: 63 elements, expected 64 \(head_dim 32 x n_kv_heads 2\)"
    ):
        load(tmp_path / "n.gguf")
    with pytest.raises(ValueError, match=r"kv_bar\.blk\.0\.k .*shape \(32, 2\), expected \(2, 32\)"):
        load([torch.zeros(D, H), torch.zeros(H, D)])
    write_fork_file(tmp_path / "f16.gguf", {0: np.zeros(H * D), 1: np.zeros(H * D)}, dtype=np.float16)
    with pytest.raises(ValueError, match=r"kv_bar\.blk\.0\.k has type F16, expected F32"):
        load(tmp_path / "f16.gguf")
    with pytest.raises(ValueError, match=r"kv_bar\.blk\.0\.k .*dtype torch\.int64"):
        load([torch.zeros(H, D, dtype=torch.long)] * 2)
    with pytest.raises(ValueError, match=r"kv_bar\.blk\.1\.k .*: 1 non-finite"):
        load(
            [
                torch.zeros(H, D),
                torch.zeros(H, D).index_put_((torch.tensor(0), torch.tensor(3)), torch.tensor(np.nan)),
            ]
        )
    with pytest.raises(ValueError, match="path, a BiasSet or a list"):
        load(3)


def test_wrong_file_type_and_schema(tmp_path):
    t = {0: np.zeros(H * D), 1: np.zeros(H * D)}
    write_fork_file(tmp_path / "imatrix.gguf", t, general_type="imatrix")
    with pytest.raises(ValueError, match="general.type is 'imatrix', expected 'kv-mean-center'"):
        load(tmp_path / "imatrix.gguf")
    path = tmp_path / "v3.gguf"  # schema 2 is kvslim's file with fitted rotations (tests/test_fitted_rotation.py)
    w = GGUFWriter(str(path), arch="")
    w.add_string("general.type", "kv-mean-center")
    w.add_uint32("kv_mean_center.schema_version", 3)
    w.add_tensor("kv_bar.blk.0.k", np.zeros(H * D, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="schema_version is 3, this kvslim reads 1 and 2"):
        load(path)
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        load(tmp_path / "junk.gguf")
    with pytest.raises(FileNotFoundError):
        load(tmp_path / "absent.gguf")


def test_k_rot_mismatch(tmp_path):
    write_fork_file(tmp_path / "rot.gguf", {0: np.zeros(H * D), 1: np.zeros(H * D)}, k_rot=True)
    with pytest.raises(
        ValueError, match=r"rotated \(k_rot=true\) K basis, but this cache stores K unrotated"
    ):
        load(tmp_path / "rot.gguf")
    assert len(load(tmp_path / "rot.gguf", k_rot=True)) == L
    with pytest.raises(ValueError, match="k_rot"):
        load(random_bias(), k_rot=True)


def test_fingerprint_mismatch(tmp_path):
    path = tmp_path / "b.gguf"
    write_bias_file(path, random_bias())
    load(path, model_fingerprint=FP)  # same model
    load(path, model_fingerprint="AB" * 32)  # bare / upper-case hex is the same fingerprint
    load(path)  # unknown on the model side: not checked
    with pytest.raises(ValueError, match="calibrated for another model"):
        load(path, model_fingerprint="sha256:" + "cd" * 32)
    with pytest.raises(ValueError, match="calibrated for another model"):
        load(random_bias(), model_fingerprint="sha256:" + "cd" * 32)
    with pytest.raises(ValueError, match="64 hex digits"):
        write_bias_file(tmp_path / "x.gguf", random_bias(model_fingerprint="md5:1234"))


def test_llama_cpp_channel_order(tmp_path):
    b = BiasSet(tensors=[torch.arange(H * D, dtype=torch.float32).reshape(H, D)] * L, model_fingerprint=FP)
    ll = to_llama_cpp_order(b, "llama")
    # llama.cpp channel 2i + r is transformers channel r * D/2 + i (convert_hf_to_gguf's q/k permutation)
    assert ll.tensors[0][0, :6].tolist() == [0, 16, 1, 17, 2, 18]
    assert ll.tensors[0][1, :2].tolist() == [32, 48] and ll.channel_order == "llama.cpp"
    assert torch.equal(from_llama_cpp_order(ll, "llama").tensors[0], b.tensors[0])
    assert torch.equal(to_llama_cpp_order(b, "qwen2").tensors[0], b.tensors[0])  # NEOX RoPE: same order
    with pytest.raises(ValueError, match="unknown whether llama.cpp permutes"):
        to_llama_cpp_order(b, "gpt2")
    with pytest.raises(ValueError, match="needs \\(H_kv, D\\) tensors"):
        to_llama_cpp_order(BiasSet(tensors=[t.reshape(-1) for t in b.tensors]), "llama")
    path = tmp_path / "ll.gguf"
    write_bias_file(path, ll)
    assert read_bias_file(path).channel_order == "llama.cpp"
    # kvslim's own --llama-cpp-order file converts back on load, for the model's architecture.
    assert all(torch.equal(t, t0) for t, t0 in zip(load(path), b.tensors, strict=True))
    with pytest.raises(ValueError, match="holds K channels in llama.cpp's order .*model_type"):
        load(path, model_type=None)


# -- CLI -------------------------------------------------------------------------------------


def test_cli_missing_text_is_one_line_error(tmp_path, capsys):
    code = main(["calibrate", "--text", str(tmp_path / "absent.txt"), "--out", str(tmp_path / "b.gguf")])
    err = capsys.readouterr().err
    assert code == 2
    assert err.strip().count("\n") == 0 and "absent.txt: no such file" in err
    (tmp_path / "empty.txt").write_text("  \n")
    assert main(["calibrate", "--text", str(tmp_path / "empty.txt"), "--out", str(tmp_path / "b.gguf")]) == 2
    assert "is empty" in capsys.readouterr().err
    code = main(
        ["calibrate", "--text", str(tmp_path / "empty.txt"), "--out", str(tmp_path / "no/dir/b.gguf")]
    )
    assert code == 2 and "does not exist" in capsys.readouterr().err


@pytest.mark.slow
def test_cli_calibrate_real_model(tmp_path, capsys, license_text):
    text = tmp_path / "text.txt"
    text.write_text(license_text)
    out = tmp_path / "bias.gguf"
    args = ["calibrate", "--text", str(text), "--ctx", "128", "--max-tokens", "256", "--out", str(out)]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "calibrated on 256 tokens in 2 chunk(s) of ctx 128" in printed
    assert "ratio" in printed and "wrote" in printed
    b = read_bias_file(out)
    assert b.n_layers == 30 and b.tensors[0].shape == (3, 64)
    # k_rot: by default the basis the default cache stores a quantized K in (Hadamard-rotated, head_dim 64)
    assert (b.n_tokens, b.n_chunks, b.ctx, b.cache_type, b.k_rot) == (256, 2, 128, "q4_0", True)
    assert b.model_fingerprint.startswith("sha256:")
    tensors = load_mean_center(
        out, n_layers=30, n_kv_heads=3, head_dim=64, model_fingerprint=b.model_fingerprint, k_rot=True
    )
    assert all(torch.isfinite(t).all() for t in tensors)
