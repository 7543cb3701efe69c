"""``kvslim bench``: the schema of the results, interleaving, the baseline, the peers' absence, and a
smoke run of the CLI. Timings are never asserted (the machine is shared and noisy)."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import save_tiny_word_model, tiny_model
from kvslim import bench
from kvslim.bench import DYNAMIC, BenchResult, decode, memory, modes, run_bench, suite

FAST = dict(warmup=1, progress=False, bandwidth_bytes=1 << 20, append_reps=2)


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def _mode_of(cache) -> str:
    from kvslim import SlimCache

    return cache.cache_config.to_spec() if isinstance(cache, SlimCache) else DYNAMIC


def test_schema(model):
    r = run_bench(
        model, ["int4", "none,sink=2,window=8"], [8, 24], 2, append_lengths=[16, 48], seen=[16, 40], **FAST
    )
    assert isinstance(r, BenchResult)
    assert r.settings["modes"] == [DYNAMIC, "int4", "none,sink=2,window=8"]
    assert [(row.mode, row.length) for row in r.decode] == [
        (m, L) for L in (8, 24) for m in (DYNAMIC, "int4", "none,sink=2,window=8")
    ]
    for row in r.decode:
        assert row.steps == 2 and row.ms_min <= row.ms_median <= row.ms_max
        assert row.ms_q1 <= row.ms_median <= row.ms_q3
        assert row.built_by == "prefill" and row.prefill_tok_s > 0
        assert row.cache_bytes > 0 and row.floor_ms > 0 and row.ratio_to_floor > 0
    # Bytes are the cache's own: the dynamic cache holds K and V of every token seen, in fp32.
    dyn = next(row for row in r.decode if row.mode == DYNAMIC and row.length == 24)
    assert dyn.tokens_stored == 24 + 1 + 2  # prefill + warm-up + timed steps
    assert dyn.cache_bytes == 2 * 2 * 2 * dyn.tokens_stored * 32 * 4  # layers x K,V x H_kv x T x D x fp32
    win = next(row for row in r.decode if row.mode == "none,sink=2,window=8" and row.length == 24)
    assert win.tokens_stored == 10
    assert [a.mode for a in r.append] == [DYNAMIC, "int4", "none,sink=2,window=8"]
    assert all(set(a.us) == {16, 48} and a.ratio > 0 for a in r.append)
    assert [(s.mode, s.seen) for s in r.streaming] == [
        ("none,sink=2,window=8", 16),
        ("none,sink=2,window=8", 40),
    ]
    assert r.streaming[0].ratio_to_first == 1.0 and r.streaming[1].tokens_stored == 10
    assert r.bandwidth_gb_s > 0 and r.model["n_kv_heads"] == 2
    json.dumps(r.to_dict())  # every number is JSON-serializable


def test_dynamic_baseline_always_present(model):
    r = run_bench(model, ["q8_0"], [8], 1, append_lengths=None, seen=None, **FAST)
    assert r.decode[0].mode == DYNAMIC and r.decode[0].kind == "dynamic"
    assert r.decode[0].ratio_to_dynamic == 1.0 and r.decode[0].paired_ratio_to_dynamic == 1.0
    assert r.decode[0].prefill_ratio_to_dynamic == 1.0
    assert {row.mode for row in r.decode} == {DYNAMIC, "q8_0"}


def test_decode_steps_are_interleaved(model, monkeypatch):
    calls = []
    real = decode.timed_decode_step

    def spy(model, cache, token):
        calls.append((_mode_of(cache), cache.get_seq_length()))  # the position the step decodes at
        return real(model, cache, token)

    monkeypatch.setattr(decode, "timed_decode_step", spy)
    monkeypatch.setattr(suite, "warm_up", lambda *a, **k: None)
    run_bench(model, ["int4", "q4_0"], [8], 3, append_lengths=None, seen=None, **FAST)
    names = {DYNAMIC, "int4", "q4_0"}
    assert len(calls) == 3 * (1 + 3)  # modes x (warm-up + steps)
    rounds = [calls[i : i + 3] for i in range(0, len(calls), 3)]
    for r, round_ in enumerate(rounds):
        assert {m for m, _ in round_} == names  # one step of every mode per round
        assert {p for _, p in round_} == {8 + r}  # at the same position
    # The order rotates, so no mode always runs first.
    assert len({round_[0][0] for round_ in rounds}) == 3


def test_copy_build_at_lengths_without_prefill(model):
    r = run_bench(model, ["int8"], [8, 16], 1, prefill_lengths=[8], append_lengths=None, seen=None, **FAST)
    built = {(row.mode, row.length): row for row in r.decode}
    assert built["int8", 8].built_by == "prefill"
    assert built["int8", 16].built_by == "copy" and built["int8", 16].prefill_tok_s is None
    assert built[DYNAMIC, 16].built_by == "prefill"
    assert built["int8", 16].tokens_stored == built[DYNAMIC, 16].tokens_stored


def test_peers_absent_are_reported_not_errors(model, monkeypatch):
    monkeypatch.setattr(
        modes,
        "peer_availability",
        lambda: {"quanto": "optimum-quanto is not installed", "hqq": "hqq is not installed"},
    )
    r = run_bench(model, ["int4"], [8], 1, peers=True, append_lengths=None, seen=None, **FAST)
    assert r.peers["quanto"] == "optimum-quanto is not installed"
    assert r.peers["hqq"] == "hqq is not installed"
    peers = [row.mode for row in r.decode if row.kind == "peer"]
    assert peers == ["tf-fp8"]  # transformers' own fp8 backend needs no package


def test_peer_backends_can_be_chosen(model):
    built, notes = bench.build_modes(model, ["int4"], peers=["fp8"])
    assert [m.name for m in built] == [DYNAMIC, "int4", "tf-fp8"] and notes == {"fp8": "available"}
    with pytest.raises(ValueError, match="unknown peer backend"):
        bench.build_modes(model, ["int4"], peers=["gptq"])


def test_peers_when_installed(model):
    avail = bench.peer_availability()
    if avail["quanto"] is not None:
        pytest.skip(avail["quanto"])
    r = run_bench(model, ["int4"], [8], 1, peers=True, append_lengths=None, seen=None, **FAST)
    names = [row.mode for row in r.decode]
    assert "quanto-int4" in names and "quanto-int2" in names
    assert all(row.cache_bytes > 0 for row in r.decode)
    pairs = r.peer_ratios()
    assert {"mode": "int4", "peer": "quanto-int4", "length": 8} in [
        {k: p[k] for k in ("mode", "peer", "length")} for p in pairs
    ]


def test_validation(model):
    with pytest.raises(ValueError, match="given twice"):
        run_bench(model, ["int4", "int4"], [8], 1, **FAST)
    with pytest.raises(ValueError, match="lengths"):
        run_bench(model, ["int4"], [0], 1, **FAST)
    with pytest.raises(ValueError, match="steps"):
        run_bench(model, ["int4"], [8], 0, **FAST)
    with pytest.raises(ValueError, match="unknown KV format"):
        run_bench(model, ["int5"], [8], 1, **FAST)
    with pytest.raises(ValueError, match="no window"):
        run_bench(model, ["int4"], [8], 1, seen=[16], seen_configs=["int4"], **FAST)
    with pytest.raises(ValueError, match="attn"):
        bench.resolve_attn("eager")


def test_attn_auto_falls_back_to_sdpa(monkeypatch):
    """'auto' is kvslim where transformers knows the 'kvslim' attention (resolving registers it), sdpa where
    it does not: the registration is taken away (a transformers that refuses it), not the check itself."""
    from transformers import AttentionInterface

    from kvslim import attention

    assert bench.resolve_attn("auto") == "kvslim"
    assert "kvslim" in AttentionInterface()
    monkeypatch.delitem(AttentionInterface._global_mapping, attention.NAME)
    monkeypatch.setattr(attention, "register", lambda: None)
    assert bench.resolve_attn("auto") == "sdpa"
    assert bench.resolve_attn("sdpa") == "sdpa"
    with pytest.raises(ValueError, match="kvslim"):
        bench.resolve_attn("kvslim")


class _Packed(torch.Tensor):
    """A wrapper tensor subclass like optimum-quanto's quantized tensors: a float tensor on the outside,
    its bytes in inner tensors (uint8 codes, float scales) that ``__tensor_flatten__`` names."""

    @staticmethod
    def __new__(cls, codes, scale):
        return torch.Tensor._make_wrapper_subclass(cls, codes.shape, dtype=torch.float32)

    def __init__(self, codes, scale):
        self._codes, self._scale = codes, scale

    def __tensor_flatten__(self):
        return ["_codes", "_scale"], None

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(func)


def test_cache_nbytes_counts_quantized_payloads():
    """A transformers-style cache (``layers``, tensors as layer attributes) holding a quantized tensor
    subclass is counted through its inner tensors (codes + scales, not the 4-byte float it poses as), and a
    storage shared by two attributes once."""
    from types import SimpleNamespace

    codes, scale = torch.zeros(6, 10, dtype=torch.uint8), torch.zeros(6, 1)
    packed = _Packed(codes, scale)
    shared = torch.zeros(8, dtype=torch.float16)
    cache = SimpleNamespace(
        layers=[SimpleNamespace(keys=packed, values=shared), SimpleNamespace(keys=(shared, torch.zeros(4)))]
    )
    assert memory.cache_nbytes(cache) == 60 + 24 + 16 + 16


@pytest.fixture
def model_dir(tmp_path):
    return save_tiny_word_model(tmp_path)


def test_cli_smoke(model_dir, tmp_path, capsys, monkeypatch):
    from kvslim.cli import main

    missing = {"quanto": "optimum-quanto is not installed", "hqq": "hqq is not installed"}
    monkeypatch.setattr(modes, "peer_availability", lambda: missing)
    out_json = tmp_path / "bench.json"
    code = main(
        [
            "bench",
            "--smoke",
            "--model",
            str(model_dir),
            "--peers",
            "--json",
            str(out_json),
            "--quiet",
            "--attn",
            "sdpa",
        ]
    )
    text = capsys.readouterr().out
    assert code == 0
    assert "dynamic" in text and "int4" in text and "optimum-quanto is not installed" in text
    assert "append cost" in text and "StreamingLLM" in text
    data = json.loads(out_json.read_text())
    assert {row["length"] for row in data["decode"]} == {16, 32}
    assert data["settings"]["steps"] == 2 and data["settings"]["attn"] == "sdpa"


def test_cli_rejects_bad_lengths(model_dir, capsys):
    from kvslim.cli import main

    assert main(["bench", "--model", str(model_dir), "--lengths", "16,x"]) == 2
    err = capsys.readouterr().err
    assert "--lengths takes comma-separated integers" in err and len(err.strip().splitlines()) == 1
    assert main(["bench", "--model", str(model_dir), "--steps", "0"]) == 2
    capsys.readouterr()
    for route in ("auto", "torch"):  # any route named, the default's name too: it applies to --concurrency only
        assert main(["bench", "--model", str(model_dir), "--linears", route]) == 2
        err = capsys.readouterr().err
        assert f"--linears {route} applies to --concurrency" in err and len(err.strip().splitlines()) == 1
