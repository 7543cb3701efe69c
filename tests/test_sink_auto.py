"""``sink=auto`` (the default): a cache that quantizes and has no window keeps its first 16 tokens at full
precision (the attention sink; docs/quality.md, "The attention sink at full precision"); a lossless cache, and a
windowed one (whose sinks are StreamingLLM's, given explicitly), keep none."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_config
from kvslim import SlimCache, parse_spec
from kvslim.config import DEFAULT_SINK, CacheConfig


@pytest.mark.parametrize(
    "spec, sinks",
    [
        ("int4", DEFAULT_SINK),
        ("q4_0", DEFAULT_SINK),
        ("k4v2", DEFAULT_SINK),
        ("fp8", DEFAULT_SINK),
        ("none,v=int2", DEFAULT_SINK),  # V alone quantized
        ("none", 0),
        ("int4,window=100", 0),  # a window's sinks are asked for
        ("int4,sink=4,window=100", 4),
        ("int4,sink=0", 0),
        ("int4,sink=64", 64),
        ("int4,sink=auto", DEFAULT_SINK),
    ],
)
def test_auto_resolves_by_format_and_window(spec, sinks):
    cfg = parse_spec(spec)
    assert cfg.sink_tokens == sinks
    assert parse_spec(cfg.to_spec()) == cfg  # auto is the default: not written, read back as auto
    if cfg.window is not None:
        assert cfg.capacity == sinks + cfg.window


def test_the_default_is_auto_everywhere():
    assert DEFAULT_SINK == 16
    assert CacheConfig().sink == "auto"
    assert SlimCache(kv_quantize="int4").cache_config.sink == "auto"
    with pytest.raises(ValueError, match="sink"):
        parse_spec("int4,sink=-1")
    with pytest.raises(ValueError, match="sink"):
        parse_spec("int4,sink=many")


def test_a_quantized_cache_keeps_its_first_tokens_at_full_precision():
    """The first 16 tokens sit in the sinks as the residual holds tokens (float16 for a float32 model), the
    encoded body starts at token 16, and nbytes counts them; ``sink=0`` encodes from token 0."""
    cfg = tiny_config()
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(1, 2, 80, 32, generator=g), torch.randn(1, 2, 80, 32, generator=g)
    auto = SlimCache(kv_quantize="int4", residual=0, config=cfg)
    none = SlimCache(kv_quantize="int4", residual=0, sink=0, config=cfg)
    for cache in (auto, none):
        cache.update(k, v, 0)
    assert auto.report()["sink"] == 16 and none.report()["sink"] == 0 and auto.report()["config"]["sink"] == "auto"
    a, n = auto.layers[0].store, none.layers[0].store
    assert a.sink_k.shape[2] == a.sink_v.shape[2] == 16 and (n.sink_k is None or n.sink_k.shape[2] == 0)
    assert torch.equal(a.sink_k, k[:, :, :16].to(torch.float16)) and torch.equal(a.sink_v, v[:, :, :16].half())
    assert a.k.n_body == 64 and n.k.n_body == 64  # 80 = 16 sinks + 2 groups + 0 left / 2 groups + 16 left
    assert len(a.k.fp) == 0 and len(n.k.fp) == 16
    kd, vd = auto.layers[0].store.read(torch.float32)
    assert torch.equal(kd[:, :, :16], k[:, :, :16].half().float())  # the sinks read back exactly as stored
    assert not torch.equal(none.layers[0].store.read(torch.float32)[0][:, :, :16], kd[:, :, :16])


def test_vllm_pages_take_sinks_only_when_asked():
    from kvslim.vllm.spec import sink_pages

    assert sink_pages(parse_spec("q4_0")) == 0  # auto: a sink page holds a staging slot per sequence
    assert sink_pages(parse_spec("q4_0,sink=16")) == 1 and sink_pages(parse_spec("q4_0,sink=33")) == 2


def test_the_cli_flag_takes_auto_and_numbers():
    import argparse

    from kvslim.cli.common import add_cache_flags, cache_config_from_args

    p = argparse.ArgumentParser()
    add_cache_flags(p)
    assert cache_config_from_args(p.parse_args(["--kv-quantize", "int4"])).sink_tokens == DEFAULT_SINK
    assert cache_config_from_args(p.parse_args(["--kv-quantize", "int4", "--streaming-llm-sink", "0"])).sink_tokens == 0
    args = p.parse_args(["--kv-quantize", "int4", "--streaming-llm-sink", "auto", "--streaming-llm-window", "64"])
    assert cache_config_from_args(args).sink_tokens == 0


@pytest.mark.parametrize("positions", ["cache", "original"])
def test_an_unbounded_caches_sinks_are_asked_once_and_a_rebase_still_moves_them(positions):
    """Frames.sink_delta remembers that no sink moves (an unbounded cache asks every step and layer) for these
    sinks, this base and this first stream slot only: a new base or first slot, or new sinks, are worked out
    again (a remembered answer that ignored them would leave a re-based cache's sinks unmoved)."""
    from kvslim.cache.frames import Frames
    from kvslim.cache.rotary import Rotary

    f = Frames(positions, Rotary(1.0 / 10000 ** (torch.arange(0, 32, 2).float() / 32)), pre_rope=False)
    f.sink_rot = torch.arange(4)[None]
    sinks = torch.zeros(1, 2, 4, 32)
    for _ in range(3):
        assert f.sink_delta(sinks, first_stream_slot=4, pads=None, sink_start=None) is None
    assert f._still == (0, 0, 4)  # remembered: the next calls read no rotation
    f._rot_host = [[9, 9, 9, 9]]  # (were the rotations read again, these would move every sink)
    assert f.sink_delta(sinks, first_stream_slot=4, pads=None, sink_start=None) is None
    f._rot_host = None
    f.base = 8  # a re-base: the sinks sit 8 positions off the new frame
    assert f.sink_delta(sinks, first_stream_slot=4, pads=None, sink_start=None, host=True) == ((-8, -8, -8, -8),)
    f.base = 0
    moved = f.sink_delta(sinks, first_stream_slot=10, pads=None, sink_start=None, host=True)
    assert moved == (((6, 6, 6, 6),) if positions == "cache" else None)
    f.sink_rot = torch.tensor([[0, 1, 2, 5]])  # new sinks: their own answer
    assert f.sink_delta(sinks, first_stream_slot=4, pads=None, sink_start=None, host=True) == ((0, 0, 0, -2),)


def test_a_left_padded_batch_with_default_sinks_reads_what_it_reads_without():
    """An unbounded cache keeps its first 16 slots as sinks, pads included (a padded row's sinks hold its pads and
    first real tokens). With fp16 storage a token's values are the same in the sinks and in the body, so a
    left-padded batch's logits through ``generate`` equal those of the same cache without sinks: the mask reaches the
    sink segment as it reaches the stream's."""
    from conftest import tiny_model

    model = tiny_model("llama")
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, 128, (3, 24), generator=g)
    mask = torch.ones_like(ids)
    for b, p in enumerate([0, 5, 19]):  # the last row: its 5 real tokens are all sinks
        ids[b, :p], mask[b, :p] = 0, 0
    kw = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0, attention_mask=mask)
    out = {}
    for sink in ("auto", 0):
        cache = SlimCache(kv_quantize="fp16", group_size=4, residual=4, sink=sink, config=model.config)
        with torch.no_grad():
            res = model.generate(ids, cache=cache, output_logits=True, return_dict_in_generate=True, **kw)
        assert cache.report()["sink"] == (16 if sink == "auto" else 0)
        out[sink] = (res.sequences, torch.stack(res.logits))
    assert torch.equal(out["auto"][0], out[0][0])
    torch.testing.assert_close(out["auto"][1], out[0][1], atol=1e-5, rtol=1e-5)


def test_a_short_static_cache_takes_the_default_and_reads_what_a_slimcache_does():
    """A static cache of at most 16 tokens under sink=auto is built (its sinks clamped below max_cache_len), and a
    greedy run through it gives the eager SlimCache's tokens; an explicit sink past it is still refused."""
    import kvslim
    from conftest import tiny_model
    from kvslim import StaticSlimCache
    from kvslim.generate import greedy

    model = kvslim.enable(tiny_model("llama"))
    prompt = torch.tensor([[5, 6, 7, 8, 9]])
    static = StaticSlimCache(kv_quantize="int4", max_cache_len=12, config=model.config)
    eager = SlimCache(kv_quantize="int4", config=model.config)
    assert greedy(model, prompt, static, 7) == greedy(model, prompt, eager, 7)
    with pytest.raises(ValueError, match="max_cache_len must exceed sink"):
        StaticSlimCache(kv_quantize="int4", sink=16, max_cache_len=12, config=model.config)
