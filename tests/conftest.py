"""Shared fixtures: tiny random-weight models of several architectures (offline, fast) and the real
embedded model (slow marker)."""

from __future__ import annotations

import os

import pytest
import torch

# Tests never reach a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

ARCHS = ["llama", "mistral", "qwen2", "qwen3", "phi3"]

#: The stable JSON schema of one `eval ppl` result (spelled out here, not imported from the library).
PPL_KEYS = {
    "config",
    "ppl",
    "ppl_stderr",
    "kld_mean",
    "kld_p99",
    "kld_max",
    "top1",
    "ppl_ratio",
    "scored_tokens",
    "curve",
}


def tiny_config(arch: str = "llama", **overrides):
    """A 2-layer random config with GQA (4 query heads, 2 KV heads, head_dim 32)."""
    import transformers as tf

    common = dict(
        vocab_size=128,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    )
    common.update(overrides)
    if arch == "llama":
        return tf.LlamaConfig(**common)
    if arch == "mistral":
        return tf.MistralConfig(sliding_window=None, **common)
    if arch == "qwen2":
        return tf.Qwen2Config(use_sliding_window=False, **common)
    if arch == "qwen3":
        common.setdefault("head_dim", 32)
        return tf.Qwen3Config(use_sliding_window=False, **common)
    if arch == "phi3":
        return tf.Phi3Config(**common)
    raise ValueError(arch)


def tiny_model(
    arch: str = "llama", dtype=torch.float32, seed: int = 0, attn_implementation="sdpa", **overrides
):
    import transformers as tf

    if attn_implementation == "kvslim":
        import kvslim

        kvslim.register()  # importing kvslim alone does not register it
    torch.manual_seed(seed)
    config = tiny_config(arch, **overrides)
    model = tf.AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
    model = model.to(dtype).eval()
    # Random init of a tiny model gives near-uniform logits; widen them so greedy decoding and
    # quantization errors are meaningful.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model


@pytest.fixture(params=ARCHS)
def arch(request):
    return request.param


@pytest.fixture(scope="session")
def real_model():
    """(model, tokenizer) of the embedded SmolLM2-135M-Instruct, fp32 on CPU."""
    from kvslim.models import load_model

    return load_model(None)


#: A real English text shipped with the tests (the GPL-3, whose license permits verbatim copies).
TEXT_PATH = os.path.join(os.path.dirname(__file__), "data", "GPL-3.txt")


@pytest.fixture(scope="session")
def text_path() -> str:
    """Path of the real English text shipped in tests/data/."""
    return TEXT_PATH


@pytest.fixture(scope="session")
def license_text():
    with open(TEXT_PATH, encoding="utf-8") as f:
        return f.read()
