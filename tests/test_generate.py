"""The shared prefill + decode loop, against transformers' own generate on tiny random models."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from conftest import tiny_model
from kvslim.generate import (
    GenerationStats,
    decode_one_token,
    generate,
    greedy,
    left_pad_position_ids,
    left_padding,
    position_ids,
    prefill,
    sample_next,
    teacher_forced,
)
from kvslim.textstream import StreamDecoder


def _ids(batch, tokens, seed=0, vocab=128):
    return torch.randint(3, vocab, (batch, tokens), generator=torch.Generator().manual_seed(seed))


def _tokens(gen) -> list[list[int]]:
    """(B, steps) token ids of a finished Generation."""
    steps = [e.tokens for e in gen]
    return [list(row) for row in zip(*steps, strict=True)]


@pytest.fixture(scope="module")
def model():
    m = tiny_model("llama")
    m.generation_config.eos_token_id = None
    return m


def test_greedy_equals_transformers_generate(model):
    ids = _ids(1, 12)
    ref = model.generate(
        ids, max_new_tokens=24, do_sample=False, cache=DynamicCache(config=model.config), pad_token_id=0
    )
    gen = generate(model, ids, DynamicCache(config=model.config), max_new_tokens=24)
    assert _tokens(gen)[0] == ref[0, 12:].tolist()
    assert gen.stats.new_tokens == 24 and gen.stats.prompt_tokens == 12 and gen.stats.decode_steps == 23


@pytest.mark.parametrize("arch", ["qwen2", "phi3"])
def test_greedy_equals_transformers_generate_other_archs(arch):
    m = tiny_model(arch)
    m.generation_config.eos_token_id = None
    ids = _ids(1, 9, seed=1)
    ref = m.generate(
        ids, max_new_tokens=10, do_sample=False, cache=DynamicCache(config=m.config), pad_token_id=0
    )
    assert (
        _tokens(generate(m, ids, DynamicCache(config=m.config), max_new_tokens=10))[0] == ref[0, 9:].tolist()
    )


def test_seeded_sampling_is_reproducible(model):
    ids = _ids(1, 8)

    def run(seed):
        cache = DynamicCache(config=model.config)
        return _tokens(
            generate(model, ids, cache, max_new_tokens=24, temperature=3.0, top_p=0.99, seed=seed)
        )[0]

    a, b, c = run(123), run(123), run(124)
    assert a == b
    assert a != c
    # The global RNG is neither used nor disturbed.
    torch.manual_seed(0)
    before = torch.rand(1)
    torch.manual_seed(0)
    run(5)
    assert torch.equal(torch.rand(1), before)


def test_chunked_prefill_equals_one_shot(model):
    ids = _ids(2, 37)
    one = prefill(model, ids, DynamicCache(config=model.config))
    for chunk in (1, 5, 16, 37, 100):
        chunked = prefill(model, ids, DynamicCache(config=model.config), chunk_size=chunk)
        torch.testing.assert_close(chunked, one, atol=1e-5, rtol=1e-5)
    assert one.shape == (2, model.config.vocab_size) and one.dtype == torch.float32


def test_chunked_prefill_with_padding_equals_one_shot(model):
    ids = _ids(2, 20)
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    one = prefill(model, ids, DynamicCache(config=model.config), attention_mask=mask)
    chunked = prefill(model, ids, DynamicCache(config=model.config), attention_mask=mask, chunk_size=6)
    torch.testing.assert_close(chunked, one, atol=1e-5, rtol=1e-5)


def test_left_padded_batch_equals_rows_alone(model):
    lengths = [5, 9, 12]
    rows = [_ids(1, n, seed=10 + i)[0] for i, n in enumerate(lengths)]
    T = max(lengths)
    ids = torch.zeros(len(rows), T, dtype=torch.long)
    mask = torch.zeros(len(rows), T, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, T - len(r) :] = r
        mask[i, T - len(r) :] = 1
    batch_logits = prefill(model, ids, DynamicCache(config=model.config), attention_mask=mask)
    batched = _tokens(
        generate(model, ids, DynamicCache(config=model.config), max_new_tokens=12, attention_mask=mask)
    )
    for i, r in enumerate(rows):
        alone_logits = prefill(model, r[None], DynamicCache(config=model.config))
        torch.testing.assert_close(batch_logits[i], alone_logits[0], atol=1e-4, rtol=1e-4)
        alone = _tokens(generate(model, r[None], DynamicCache(config=model.config), max_new_tokens=12))[0]
        assert batched[i] == alone, f"row {i}"


def test_left_pad_position_ids():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    assert left_pad_position_ids(mask).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 4]]


def test_decode_one_token_matches_full_forward(model):
    ids = _ids(1, 10)
    cache = DynamicCache(config=model.config)
    prefill(model, ids[:, :9], cache)
    step = decode_one_token(model, ids[:, 9:], cache)
    full = model(ids).logits[:, -1].float()
    torch.testing.assert_close(step, full, atol=1e-5, rtol=1e-5)


def test_eos_stops_and_pads(model):
    ids = _ids(1, 12)
    first = _tokens(generate(model, ids, DynamicCache(config=model.config), max_new_tokens=6))[0]
    eos = first[2]
    gen = generate(model, ids, DynamicCache(config=model.config), max_new_tokens=6, eos_token_id=[eos, 9999])
    events = list(gen)
    assert [e.tokens[0] for e in events] == first[:3]
    assert events[-1].done and gen.stats.new_tokens == 3


def test_sample_next_rules():
    logits = torch.tensor([[0.0, 3.0, 2.9, -1.0], [5.0, 0.0, 0.0, 0.0]])
    assert sample_next(logits, 0.0).tolist() == [1, 0]
    g = torch.Generator().manual_seed(0)
    # top_p tiny: only the most likely token survives.
    for _ in range(20):
        assert sample_next(logits, 1.0, 1e-6, g).tolist() == [1, 0]
    # top_p 0.6 on row 0 keeps tokens 1 and 2 (0.49 + 0.45 > 0.6 only with both), never 0 or 3.
    drawn = {sample_next(logits, 1.0, 0.6, g)[0].item() for _ in range(200)}
    assert drawn == {1, 2}
    for bad in (dict(temperature=-1.0), dict(temperature=float("nan")), dict(top_p=0.0), dict(top_p=1.5)):
        with pytest.raises(ValueError):
            sample_next(logits, **{"temperature": 1.0, "top_p": 1.0, **bad})


def test_generate_validates(model):
    ids = _ids(1, 4)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(model, ids, DynamicCache(config=model.config), max_new_tokens=0)
    with pytest.raises(ValueError, match="chunk_size"):
        prefill(model, ids, DynamicCache(config=model.config), chunk_size=0)


def test_stats_survive_interruption(model):
    gen = generate(model, _ids(1, 6), DynamicCache(config=model.config), max_new_tokens=50)
    for event in gen:
        assert not torch.is_inference_mode_enabled()  # the mode never leaks out across a yield
        if event.step == 4:
            break
    gen.close()
    assert gen.stats.new_tokens == 5 and gen.stats.prefill_s > 0 and gen.stats.decode_s > 0
    assert gen.stats.decode_tokens_per_s > 0
    assert GenerationStats().to_dict()["new_tokens"] == 0


class ByteTokenizer:
    """Each token is one UTF-8 byte: the hardest case for a streaming decoder."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


def test_stream_decoder_multibyte_characters():
    text = "héllo wörld — 世界 🙂 done"
    dec = StreamDecoder(ByteTokenizer())
    pieces = [dec.push(b) for b in text.encode()]
    pieces.append(dec.flush())
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)
    # The emoji's four bytes print once, as one piece, on the last byte.
    assert "🙂" in pieces


def test_stream_decoder_window_stays_bounded():
    dec = StreamDecoder(ByteTokenizer(), prompt_ids=list(b"prompt"))
    out = []
    for i in range(5000):
        out.append(dec.push(ord("a") + i % 26))
        assert len(dec._ids) <= 8
    assert "".join(out) == "".join(chr(ord("a") + i % 26) for i in range(5000))


def test_stream_decoder_flush_prints_incomplete_tail():
    dec = StreamDecoder(ByteTokenizer())
    assert dec.push(0xE4) == ""  # first byte of a 3-byte character
    assert dec.flush() == "\ufffd"


@pytest.mark.slow
def test_stream_decoder_real_tokenizer(real_model):
    _, tok = real_model
    text = " The café served crème brûlée 🍮 and 寿司, said Zoë."
    ids = tok(text, add_special_tokens=False).input_ids
    dec = StreamDecoder(tok, prompt_ids=tok("Menu:", add_special_tokens=False).input_ids)
    pieces = [dec.push(i) for i in ids] + [dec.flush()]
    assert "".join(pieces) == tok.decode(ids)
    assert not any("\ufffd" in p for p in pieces)


# -- positions: one owner ------------------------------------------------------------------------


def test_position_ids_follow_the_cache_and_padding():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    pads = left_padding(mask)
    assert pads.tolist() == [2, 0]
    empty = DynamicCache()
    assert torch.equal(position_ids(empty, 5, pads=pads), left_pad_position_ids(mask))
    assert position_ids(empty, 3).tolist() == [[0, 1, 2]]


def test_left_padding_refuses_other_masks():
    with pytest.raises(ValueError, match="left padding"):
        left_padding(torch.tensor([[1, 1, 0]]))
    with pytest.raises(ValueError, match="left padding"):
        left_padding(torch.tensor([[1, 0, 1]]))


def test_padding_is_handed_to_a_slim_cache_once(model):
    """The library loop hands the padding explicitly; generate() relies on the position-id convention:
    both keep each row's first real tokens as sinks, so a left-padded StreamingLLM batch decodes the same."""
    from kvslim import SlimCache

    ids = _ids(3, 10, seed=4)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    mask[2, :7] = 0
    ids = ids.masked_fill(mask == 0, 0)
    spec = dict(kv_quantize="q8_0", sink=2, window=8, residual=0, group_size=1, config=model.config)
    ours_cache = SlimCache(**spec)
    ours = _tokens(generate(model, ids, ours_cache, max_new_tokens=20, attention_mask=mask))
    assert ours_cache.padding_explicit and ours_cache.pads.tolist() == [0, 4, 7]
    ref = model.generate(
        ids,
        attention_mask=mask,
        cache=SlimCache(**spec),
        max_new_tokens=20,
        min_new_tokens=20,
        do_sample=False,
        pad_token_id=0,
    )
    assert ours == ref[:, 10:].tolist()
    with pytest.raises(ValueError, match="before the first token"):
        ours_cache.set_left_padding(None)


def test_teacher_forced_equals_one_full_forward(model):
    ids = _ids(1, 30, seed=5)
    full = model(ids, use_cache=False).logits[0].float()  # the independent reference
    got = torch.cat(
        [lg for _, lg in teacher_forced(model, ids, DynamicCache(config=model.config), prefill=7, chunk=4)]
    )
    torch.testing.assert_close(got, full[6:-1], atol=1e-5, rtol=1e-5)


def test_greedy_follows_and_stops(model):
    ids = _ids(1, 8, seed=6)
    ref = model.generate(
        ids, max_new_tokens=10, do_sample=False, cache=DynamicCache(config=model.config), pad_token_id=0
    )
    out = greedy(model, ids, DynamicCache(config=model.config), 10)
    assert out == ref[0, 8:].tolist()
    wrong = list(out)
    wrong[3] = (wrong[3] + 1) % 128
    assert greedy(model, ids, DynamicCache(config=model.config), 10, follow=wrong) == out[:4]
