"""kvslim.evaluate: quality measured through the cached path.

Fast tests run tiny random models; the ``slow`` ones the embedded SmolLM2-135M with small N.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from conftest import PPL_KEYS, tiny_model
from kvslim import parse_spec
from kvslim.evaluate import (
    BUILTIN_PROMPTS,
    LONG_PROMPTS,
    KVBits,
    ModelShape,
    PerplexityResult,
    Prompt,
    cache_bytes,
    compare_perplexity,
    encode_prompt,
    full_forward_nll,
    greedy_prefix_match,
    kv_bits,
    load_prompts,
    long_generation,
    memory_records,
    memory_table,
    passkey_answer_correct,
    perplexity_through_cache,
    resolve_modes,
    stream_layout,
)

#: A perplexity record: conftest's keys and the bits per element of the cache the text went through.
PPL_RECORD_KEYS = PPL_KEYS | {"bits_per_element", "bits"}


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def ids():
    g = torch.Generator().manual_seed(1)
    return torch.randint(3, 128, (1, 96), generator=g)


def dynamic(model):
    from transformers import DynamicCache

    return lambda cfg=None: DynamicCache(config=model.config)


def slim(model, spec):
    from kvslim import SlimCache

    return lambda: SlimCache.from_config(parse_spec(spec), config=model.config)


# -- modes ------------------------------------------------------------------------------------
def test_resolve_modes_reference_first_and_deduplicated():
    modes = resolve_modes(["int4", "none", "int4,group=32", "q4_0,sink=4,window=60"])
    assert [m.label for m in modes] == ["none", "int4", "q4_0,sink=4,window=60"]


def test_resolve_modes_bad_spec_names_it():
    with pytest.raises(ValueError, match="int5"):
        resolve_modes(["int5"])


# -- perplexity -------------------------------------------------------------------------------
@pytest.mark.parametrize("chunk", [1, 7])
def test_exactness_dynamic_cache(model, ids, chunk):
    """The cached path with an identity cache equals one plain forward (the harness itself is exact)."""
    ref = full_forward_nll(model, ids, prefill=20)
    res = perplexity_through_cache(model, ids, dynamic(model), prefill=20, chunk=chunk, progress=False)
    assert res.n_scored == ids.shape[1] - 20
    assert res.ppl == pytest.approx(math.exp(float(ref.mean())), rel=1e-4)
    assert torch.allclose(res.nll, ref, atol=1e-4)


@pytest.mark.parametrize("chunk", [1, 5])
def test_exactness_reference_slim_cache(model, ids, chunk):
    """Issue 5's check: the reference mode through SlimCache == the full-sequence forward, to 1e-4 relative."""
    ref_ppl = math.exp(float(full_forward_nll(model, ids, prefill=16).mean()))
    res = perplexity_through_cache(model, ids, slim(model, "none"), prefill=16, chunk=chunk, progress=False)
    assert abs(res.ppl / ref_ppl - 1) < 1e-4


@pytest.mark.parametrize("spec", ["none", "none,sink=4,window=10000", "int4,residual=0,sink=4,window=10000"])
def test_kl_exactly_zero_for_identity_modes(model, ids, spec):
    """KL exactly 0 and top-1 1.0 for the reference and for a window longer than the text.

    (int4 without a residual, window longer than the text, is the lossy control: KL > 0.)"""
    _, ref_logits = perplexity_through_cache(
        model, ids, slim(model, "none"), prefill=16, keep_logits=True, progress=False
    )
    res = perplexity_through_cache(
        model, ids, slim(model, spec), prefill=16, reference_logits=ref_logits, progress=False
    )
    if spec.startswith("none"):
        assert res.kld_max == 0.0 and res.kld_mean == 0.0
        assert res.top1 == 1.0
    else:
        assert res.kld_mean > 0.0


def test_compare_report_reference_and_lossy(model, ids):
    report = compare_perplexity(
        model, ids, ["int2,residual=0", "none,sink=4,window=10000"], prefill=16, chunk=3, progress=False
    )
    recs = report.records(bucket=32)
    assert [r["config"] for r in recs] == ["none", "int2,residual=0", "none,sink=4,window=10000"]
    ref, lossy, window = recs
    assert ref["kld_mean"] == 0.0 and ref["top1"] == 1.0 and ref["ppl_ratio"] == 1.0
    assert window["kld_max"] == 0.0 and window["top1"] == 1.0 and window["ppl"] == ref["ppl"]
    assert lossy["kld_mean"] > 0 and lossy["kld_max"] >= lossy["kld_p99"] >= 0
    assert all(set(r) == PPL_RECORD_KEYS for r in recs)
    # bits per element of the caches the text went through, after its 95 fed tokens: the fp32 reference
    # and the window at 32 bits, int2 below 32
    assert all(r["bits"]["tokens_seen"] == 95 for r in recs)
    assert ref["bits_per_element"] == 32.0 and window["bits_per_element"] == 32.0
    assert lossy["bits_per_element"] < 32.0


def test_lockstep_equals_stored_reference(model, ids):
    specs = ["int4,residual=32", "q4_0,sink=4,window=40,residual=0"]
    stored = compare_perplexity(model, ids, specs, prefill=16, chunk=4, progress=False)
    lockstep = compare_perplexity(
        model, ids, specs, prefill=16, chunk=4, progress=False, max_reference_bytes=0
    )
    for a, b in zip(stored.results, lockstep.results):
        assert a.config == b.config
        assert torch.equal(a.nll, b.nll) and torch.equal(a.kld, b.kld) and torch.equal(a.agree, b.agree)
        assert a.bits == b.bits and a.bits is not None


def test_compare_perplexity_any_cache_maker_reference_is_exact(model, ids):
    """Without SlimCache: compare_perplexity runs with any cache maker; the reference row's NLL is the
    plain full forward's (its KL 0 and top-1 1 are set by construction, so they are not the check)."""
    report = compare_perplexity(model, ids, [], prefill=16, progress=False, make_cache=dynamic(model))
    (ref,) = report.results
    assert torch.allclose(ref.nll, full_forward_nll(model, ids, prefill=16), atol=1e-4)
    assert ref.kld_max == 0.0 and ref.top1 == 1.0


def test_metrics_formulas():
    nll = torch.tensor([1.0, 2.0, 3.0, 2.0], dtype=torch.float64)
    kld = torch.tensor([0.0, 0.1, 0.2, 0.3], dtype=torch.float64)
    agree = torch.tensor([True, True, False, True])
    r = PerplexityResult("x", tokens=10, prefill=6, chunk=1, nll=nll, kld=kld, agree=agree)
    assert r.ppl == pytest.approx(math.exp(2.0))
    assert r.ppl_stderr == pytest.approx(math.exp(2.0) * float(nll.std()) / 2.0)
    assert r.kld_max == pytest.approx(0.3) and r.top1 == 0.75
    assert r.kld_p99 == pytest.approx(0.297)
    # positions 6..9 in buckets of 4: [6, 8) and [8, 10)
    assert [(p["start"], p["end"]) for p in r.curve(4)] == [(6, 8), (8, 10)]
    assert r.curve(4)[0]["ppl"] == pytest.approx(math.exp(1.5))
    with pytest.raises(ValueError, match="bucket"):
        r.curve(0)


def test_bad_arguments(model, ids):
    with pytest.raises(ValueError, match="prefill"):
        perplexity_through_cache(model, ids, dynamic(model), prefill=96, progress=False)
    with pytest.raises(ValueError, match="chunk"):
        perplexity_through_cache(model, ids, dynamic(model), prefill=4, chunk=0, progress=False)
    with pytest.raises(ValueError, match=r"\(1, N\)"):
        perplexity_through_cache(model, ids[0], dynamic(model), prefill=4, progress=False)
    with pytest.raises(ValueError, match="reference_logits"):
        perplexity_through_cache(
            model, ids, dynamic(model), prefill=4, reference_logits=torch.zeros(3, 128), progress=False
        )


# -- greedy -----------------------------------------------------------------------------------
class CharTokenizer:
    """A stand-in tokenizer: one id per character, BOS = 1 when special tokens are added, and a chat
    template ``<|role|>content\\n`` ending in ``<|assistant|>``."""

    bos_token_id = 1

    def __init__(self, chat_template: str | None = "yes"):
        self.chat_template = chat_template

    def __call__(self, text, return_tensors=None, add_special_tokens=True):
        ids = [self.bos_token_id] * add_special_tokens + [ord(c) for c in text]
        return SimpleNamespace(input_ids=torch.tensor([ids]) if return_tensors == "pt" else ids)

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        assert not tokenize
        text = "".join(f"<|{m['role']}|>{m['content']}\n" for m in messages)
        return text + "<|assistant|>" * add_generation_prompt


def test_encode_builtin_prompts():
    """Plain prompts are tokenized with special tokens; chat prompts are wrapped in the template
    (without a second BOS), or left plain when the tokenizer has no template."""
    tok, plain_tok = CharTokenizer(), CharTokenizer(chat_template=None)
    assert {p.chat for p in BUILTIN_PROMPTS} == {True, False}  # both paths below are exercised
    for p in BUILTIN_PROMPTS:
        chars = [ord(c) for c in p.text]
        wrapped = [ord(c) for c in "<|user|>"] + chars + [ord(c) for c in "\n<|assistant|>"]
        expected = wrapped if p.chat else [1, *chars]
        assert encode_prompt(tok, p).tolist() == [expected], p.name
        assert encode_prompt(plain_tok, p).tolist() == [[1, *chars]], p.name
    assert encode_prompt(tok, "ab").tolist() == [[1, 97, 98]]
    assert encode_prompt(None, [5, 6]).tolist() == [[5, 6]]
    assert encode_prompt(None, torch.tensor([5, 6])).tolist() == [[5, 6]]
    with pytest.raises(ValueError, match="tokenizer"):
        encode_prompt(None, "ab")


def test_load_prompts(tmp_path):
    f = tmp_path / "p.txt"
    f.write_text("hello\n\nchat: hi there\\nfriend\n")
    assert load_prompts(str(f)) == [Prompt("line1", "hello"), Prompt("line3", "hi there\nfriend", chat=True)]
    (tmp_path / "e.txt").write_text("\n\n")
    with pytest.raises(ValueError, match="no prompts"):
        load_prompts(str(tmp_path / "e.txt"))


def test_greedy_prefix_match_identity_and_lossy(model):
    prompts = [[5, 6, 7, 8, 9], [40, 41, 42], list(range(10, 40))]
    report = greedy_prefix_match(
        model, None, prompts, ["none,sink=2,window=10000", "int2,residual=0"], tokens=24, progress=False
    )
    ref, window, lossy = report.results
    assert [r.config for r in report.results] == ["none", "none,sink=2,window=10000", "int2,residual=0"]
    assert ref.prefix_match_mean == 1.0 and window.prefix_match_mean == 1.0
    assert set(report.records()[0]) == {"config", "prefix_match_mean", "bits_per_element", "bits", "prompts"}
    assert ref.bits_per_element == 32.0 and ref.bits.tokens_seen == 30 + 24 - 1  # the longest prompt's run
    assert lossy.prefix_match_mean < 1.0  # int2 without a residual diverges: the count below is exercised
    # Independent values: the reference continuation by argmax over plain no-cache forwards, and the
    # lossy mode's match counted by hand from its full 24-token continuation (no early stop).
    from kvslim.generate import greedy

    for prompt, ref_tokens, match in zip(prompts, report.reference_tokens, lossy.prompts):
        seq = list(prompt)
        with torch.no_grad():
            for _ in range(24):
                seq.append(int(model(torch.tensor([seq]), use_cache=False).logits[0, -1].argmax()))
        assert ref_tokens == seq[len(prompt) :]
        out = greedy(model, torch.tensor([prompt]), slim(model, "int2,residual=0")(), 24)
        matched = next((i for i, (a, b) in enumerate(zip(out, ref_tokens)) if a != b), 24)
        assert (match.matched, match.reference_tokens, match.prompt_tokens) == (matched, 24, len(prompt))
    assert lossy.prefix_match_mean == pytest.approx(
        sum(p.matched for p in lossy.prompts) / (24 * len(prompts))
    )


# -- long generation (free-running) -----------------------------------------------------------
def plain_greedy(model, seq: list[int], n: int) -> list[int]:
    """``n`` greedy tokens after ``seq`` by argmax over plain no-cache forwards (an independent oracle)."""
    seq = list(seq)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(model(torch.tensor([seq]), use_cache=False).logits[0, -1].argmax()))
    return seq[-n:]


def plain_logits(model, seq: list[int]) -> torch.Tensor:
    """(len(seq), V) logits of one plain no-cache forward."""
    with torch.no_grad():
        return model(torch.tensor([seq]), use_cache=False).logits[0].double()


def test_long_generation_identical_mode_is_exact(model):
    """A mode whose forwards are the reference's (a window longer than the run) never diverges, and its
    own continuation scored by the reference has KL exactly 0 and ref top-1 1 at every position."""
    prompts = [[5, 6, 7, 8, 9], list(range(10, 40))]
    report = long_generation(model, None, prompts, ["none,sink=2,window=10000"], tokens=20, progress=False)
    ref, window = report.results
    assert [r.config for r in report.results] == ["none", "none,sink=2,window=10000"]
    for prompt, ref_tokens in zip(prompts, report.reference_tokens):
        assert ref_tokens == plain_greedy(model, prompt, 20)  # the reference is the model's greedy text
    for res in (ref, window):
        assert res.diverged == 0 and all(r.first_divergence is None for r in res.runs)
        assert res.divergence_min == 20 and res.prefix_mean == 1.0 and res.match_mean == 1.0
        for run in res.runs:
            assert run.n == 20 and torch.equal(run.kld, torch.zeros(20, dtype=torch.float64))
            assert bool(run.ref_agree.all())
        assert res.kld_max == 0.0 and res.ref_top1 == 1.0
    assert window.ref_ppl == ref.ref_ppl
    # the reference's NLL of its own text, from an independent plain forward
    prompt, cont = prompts[0], report.reference_tokens[0]
    logp = torch.log_softmax(plain_logits(model, prompt + cont), -1)[len(prompt) - 1 : -1]  # (20, V)
    nll = -logp.gather(1, torch.tensor(cont)[:, None])[:, 0]
    assert torch.allclose(ref.runs[0].ref_nll, nll, atol=1e-5)


class ForcedToken:
    """The tiny model, except through a cache with a ``force = (seen, token)`` attribute: the forward that
    brings that cache to ``seen`` tokens has ``token`` raised 5 above the top logit. A constructed lossy
    mode whose first divergence is known by hand."""

    def __init__(self, inner):
        self.inner, self.config, self.device = inner, inner.config, inner.device

    def __call__(self, **kwargs):
        from kvslim.compat import CACHE_KWARG

        out = self.inner(**kwargs)
        cache = kwargs[CACHE_KWARG]
        force = getattr(cache, "force", None)
        if force is not None and cache.get_seq_length() == force[0]:
            out.logits[:, -1, force[1]] = out.logits[:, -1].max() + 5.0
        return out


def test_long_generation_constructed_divergence(model):
    """The mode's logits are the reference's except at continuation position d = 7, where a token other than
    the reference's is forced. Everything is checked against hand values from plain no-cache forwards:
    first divergence 7, KL exactly 0 before it, KL(ref || forced) at it, the mode's own continuation after
    it (the reference reading the forced token), and the position-wise match."""
    from transformers import DynamicCache

    prompt, n, d = [5, 6, 7, 8, 9], 16, 7
    ref_tokens = plain_greedy(model, prompt, n)
    x = (ref_tokens[d] + 1) % model.config.vocab_size
    none = parse_spec("none")

    def make(cfg):
        cache = DynamicCache(config=model.config)
        if cfg != none:
            cache.force = (len(prompt) + d, x)  # the forward predicting continuation token d
        return cache

    report = long_generation(
        ForcedToken(model), None, [prompt], ["int2"], tokens=n, progress=False, make_cache=make
    )
    assert report.reference_tokens == [ref_tokens]
    (run,) = report.results[1].runs
    mode_tokens = ref_tokens[:d] + [x] + plain_greedy(model, prompt + ref_tokens[:d] + [x], n - d - 1)
    assert run.tokens == mode_tokens
    assert run.first_divergence == d and run.matched == d and run.prefix == d / n
    assert run.position_match == sum(a == b for a, b in zip(mode_tokens, ref_tokens)) / n
    assert torch.equal(run.kld[:d], torch.zeros(d, dtype=torch.float64))  # identical forwards
    assert bool(run.ref_agree[:d].all()) and not bool(run.ref_agree[d])
    # KL at d by hand: the reference's logits there, and the same with x raised above the top
    ref_l = plain_logits(model, prompt + ref_tokens[:d])[-1]
    forced = ref_l.clone()
    forced[x] = ref_l.max() + 5.0
    p, q = torch.log_softmax(ref_l, -1), torch.log_softmax(forced, -1)
    assert float(run.kld[d]) == pytest.approx(float((p.exp() * (p - q)).sum()), rel=1e-4)
    # after d both read the mode's own history (forced token included), unforced: KL 0 again
    assert torch.equal(run.kld[d + 1 :], torch.zeros(n - d - 1, dtype=torch.float64))
    summary = report.records(bucket=8)[1]
    assert summary["diverged"] == 1 and summary["divergence_min"] == d and summary["divergence_median"] == d
    assert [c["alive"] for c in summary["curve"]] == [1.0, 0.0]  # diverged at 7: alive at 0, not at 8


def test_long_generation_lossy_mode_own_continuation(model):
    """A real lossy mode (int2 in groups of 8, without a residual) against independent computations: its continuation from
    its own greedy decode, the first divergence counted by hand, and KL(reference || mode) at every position
    of its own continuation — the reference's logits from one plain forward over prompt + its tokens, the
    mode's from teacher-forcing its tokens through its own cache (the same forwards as its generation)."""
    from kvslim.generate import greedy

    prompts, n = [[5, 6, 7, 8, 9], [40, 41, 42]], 24
    report = long_generation(model, None, prompts, ["int2,group=8,residual=0,sink=0"], tokens=n, progress=False)
    lossy = report.results[1]
    assert lossy.diverged >= 1  # the case below is exercised
    for prompt, ref_tokens, run in zip(prompts, report.reference_tokens, lossy.runs):
        own = greedy(model, torch.tensor([prompt]), slim(model, "int2,group=8,residual=0,sink=0")(), n)
        assert run.tokens == own
        first = next((i for i, (a, b) in enumerate(zip(own, ref_tokens)) if a != b), None)
        assert run.first_divergence == first
        seq = torch.tensor([prompt + own])
        mode_res, mode_logits = perplexity_through_cache(
            model,
            seq,
            slim(model, "int2,group=8,residual=0,sink=0"),
            prefill=len(prompt),
            keep_logits=True,
            progress=False,
        )
        ref_logp = torch.log_softmax(plain_logits(model, prompt + own)[len(prompt) - 1 :], -1)  # (n+1, V)
        ref_logp = ref_logp[:n]
        mode_logp = torch.log_softmax(mode_logits.double(), -1)  # (n, V): predicts own[0..n-1]
        kl = (ref_logp.exp() * (ref_logp - mode_logp)).sum(-1)
        assert torch.allclose(run.kld, kl, atol=1e-5)
        assert torch.equal(run.ref_agree, ref_logp.argmax(-1) == torch.tensor(own))
    assert lossy.kld_mean > 0 and lossy.kld_max >= lossy.kld_p99 >= 0
    assert lossy.bits.tokens_seen == max(len(p) for p in prompts) + n - 1


def test_long_generation_stop_at_eos_and_arguments(model):
    tok = SimpleNamespace(eos_token_id=None)
    report = long_generation(model, tok, [[5, 6, 7]], ["int4,residual=0"], tokens=6, progress=False)
    ref_tokens = report.reference_tokens[0]
    # the reference's 3rd token as "EOS": every run ends where the reference first emits it, the mode's too
    tok = SimpleNamespace(eos_token_id=ref_tokens[2])
    k = ref_tokens.index(ref_tokens[2]) + 1
    stopped = long_generation(
        model, tok, [[5, 6, 7]], ["int4,residual=0"], tokens=6, stop_at_eos=True, progress=False
    )
    assert stopped.reference_tokens == [ref_tokens[:k]] and k < 6
    assert [r.runs[0].n for r in stopped.results] == [k, k]
    with pytest.raises(ValueError, match="tokens"):
        long_generation(model, None, [[5, 6]], [], tokens=0, progress=False)
    with pytest.raises(ValueError, match="no prompts"):
        long_generation(model, None, [], [], tokens=2, progress=False)
    with pytest.raises(ValueError, match="bucket"):
        report.results[0].curve(0)
    assert {p.chat for p in LONG_PROMPTS} == {True, False} and len(LONG_PROMPTS) >= 3


# -- bits per element ---------------------------------------------------------------------------
def fed_cache(model, spec: str, prefill: int, steps: int, dtype=torch.float32):
    """A SlimCache of ``spec`` fed ``prefill`` tokens at once, then ``steps`` single tokens, through its own
    update (random K/V of the tiny model's shapes: 2 layers, 2 KV heads, head_dim 32)."""
    from kvslim import SlimCache

    cache = SlimCache.from_config(parse_spec(spec), config=model.config)
    g = torch.Generator().manual_seed(0)
    for n in [prefill] + [1] * steps:
        for layer in range(2):
            k, v = torch.randn(2, 1, 2, n, 32, generator=g).to(dtype)
            cache.update(k, v, layer)
    return cache


def test_bits_per_element_hand_counts(model):
    """Bits per stored K/V element, against counts by hand (per layer and KV head; head_dim D = 32).

    int4 (KIVI): K codes D/2 bytes a token + an fp16 scale and zero per channel per 32-token group
    (4 D / 32 bytes a token); V codes D/2 + an fp16 scale and zero per token (4 bytes). For D = 32: 20 bytes
    per 32 elements, 5 bits, K and V alike. Tokens leave the residual 32 at a time; the rest are fp16.
    """
    none32 = kv_bits(fed_cache(model, "none", 96, 0))
    assert none32 == KVBits(96, 96, 96 * 2 * 2 * 64, 96 * 2 * 2 * 64 * 4)
    assert none32.bits_per_element == 32.0
    assert kv_bits(fed_cache(model, "none", 96, 4, torch.float16)).bits_per_element == 16.0
    assert kv_bits(fed_cache(model, "fp16,residual=0", 50, 3)).bits_per_element == 16.0
    assert kv_bits(fed_cache(model, "int4,residual=0,sink=0", 90, 6)).bits_per_element == 5.0  # 96 = 3 groups
    # int4 with its default residual of 128 and no sinks, after 200 tokens: 64 encoded (2 groups), 136 in fp16
    k = 64 * 16 + 2 * 2 * 2 * 32 + 136 * 32 * 2  # codes, scale+zero per channel per group, residual
    v = 64 * 16 + 64 * 2 * 2 + 136 * 32 * 2  # codes, scale+zero per token, residual
    bits = kv_bits(fed_cache(model, "int4,sink=0", 100, 100))
    assert (bits.tokens_seen, bits.stored_tokens, bits.elements) == (200, 200, 200 * 64 * 2 * 2)
    assert bits.bytes == 2 * 2 * (k + v)  # 2 layers x 2 KV heads
    assert bits.bits_per_element == pytest.approx(8 * (k + v) / (200 * 64))  # 12.48
    # the default int4 (sink=auto): its 16 first tokens in fp16 as well, then 32 encoded (184 = 32 + 152)
    k = 32 * 16 + 1 * 2 * 2 * 32 + (16 + 152) * 32 * 2
    v = 32 * 16 + 32 * 2 * 2 + (16 + 152) * 32 * 2
    bits = kv_bits(fed_cache(model, "int4", 100, 100))
    assert bits.bytes == 2 * 2 * (k + v)
    # a window stores sinks + window tokens, and those are the denominator (4 fp16 sinks + 100 tokens); the
    # bytes as cache_bytes counts them (the formula, itself tested against the real tensors)
    cfg = "int4,sink=4,window=100"
    cache = fed_cache(model, cfg, 40, 160)
    bits = kv_bits(cache)
    stored, nbytes = cache_bytes(ModelShape.from_config(model.config), parse_spec(cfg), 200, prefill=40)
    assert (bits.stored_tokens, bits.bytes) == (stored, nbytes) == (104, cache.live_nbytes())
    assert bits.elements == 104 * 2 * 2 * 64
    # any other cache: its tensors
    dyn = dynamic(model)()
    dyn.update(*torch.randn(2, 1, 2, 10, 32), 0)
    dyn.update(*torch.randn(2, 1, 2, 10, 32), 1)
    assert kv_bits(dyn).bits_per_element == 32.0 and kv_bits(dyn).elements == 2 * 2 * 10 * 64


@pytest.mark.parametrize("spec", ["int4,group=4,residual=8", "q4_0,sink=2,window=8,group=4,residual=0"])
def test_bits_per_element_static_cache_equals_eager(spec):
    """A static cache holds its capacity from the first write; its bits are those of the tokens it stores,
    the same as the eager SlimCache's (so `eval greedy --compile` reports what eager does)."""
    from kvslim import SlimCache, StaticSlimCache
    from kvslim.generate import greedy

    model = tiny_model("llama", attn_implementation="kvslim")
    cfg, prompt = parse_spec(spec), torch.tensor([[5, 6, 7, 8, 9, 10, 11]])
    eager = SlimCache.from_config(cfg, config=model.config)
    static = StaticSlimCache.from_config(cfg, config=model.config, max_cache_len=40)
    for cache in (eager, static):
        greedy(model, prompt, cache, 20)
    assert kv_bits(static) == kv_bits(eager) and kv_bits(eager).tokens_seen == 26
    assert static.nbytes() > eager.live_nbytes()  # what it really holds: its capacity


def test_memory_table_bits_per_element():
    shape = ModelShape(layers=30, kv_heads=3, head_dim=64, dtype=torch.float32)
    rows = memory_table(shape, ["fp16,residual=0,sink=0", "int4,residual=0,sink=0"], [1024])
    # int4 at D = 64, per token and head: K 32 code bytes + 8 of scale/zero per channel per 32 tokens, V 32 +
    # a 4-byte scale/zero: 76 bytes per 128 elements
    assert [r.bits_per_element for r in rows] == [32.0, 16.0, 76 * 8 / 128]
    assert memory_records(rows)[2]["bits_per_element"] == [rows[2].bits_per_element]


# -- passkey ----------------------------------------------------------------------------------
def test_passkey_answer_check():
    assert passkey_answer_correct(" 12345. Remember", "12345")
    assert not passkey_answer_correct("1234", "12345")
    assert not passkey_answer_correct("no digits", "12345")
    assert not passkey_answer_correct("99999 or 12345", "12345")


# -- memory -----------------------------------------------------------------------------------
def test_stream_layout_accounting():
    # residual 128, unit 32: 200 tokens -> 64 encoded (2 K groups of 32), 136 at full precision
    assert stream_layout(200, lossy=True, residual=128, unit=32, group=32) == (64, 2, 136)
    # a per-token format leaves the residual in the same units; its "groups" are single tokens
    assert stream_layout(200, lossy=True, residual=128, unit=32, group=1) == (64, 64, 136)
    # residual 32: 160 encoded, 40 fp; a window of 100 evicts 100 encoded tokens: 60 left, whose first
    # 28 belong to a partly evicted group that keeps its scales -> 2 groups
    assert stream_layout(200, lossy=True, residual=32, unit=32, group=32, window=100) == (60, 2, 40)
    # llama.cpp's way: no residual, unit 1: everything encoded on arrival
    assert stream_layout(7, lossy=True, residual=0, unit=1, group=1) == (7, 7, 0)
    # a window shorter than residual + unit - 1: tokens leave before a unit completes
    assert stream_layout(500, lossy=True, residual=128, unit=32, group=32, window=100) == (0, 0, 100)
    assert stream_layout(500, lossy=False, residual=128, unit=32, window=100) == (0, 0, 100)
    # ... except what a big first chunk encoded at once: 100 -> 96 encoded (3 groups) + 4 fp; a window
    # of 10 keeps 6 encoded tokens (1 group) + 4 fp; 5 single steps then evict 5 more encoded ones
    kw = dict(lossy=True, residual=0, unit=32, group=32, window=10, prefill=100)
    assert stream_layout(100, **kw) == (6, 1, 4)
    assert stream_layout(105, **kw) == (1, 1, 9)
    assert stream_layout(107, **kw) == (0, 0, 10)


def test_memory_table_shape_and_ratios():
    shape = ModelShape(layers=30, kv_heads=3, head_dim=64, dtype=torch.float32)
    rows = memory_table(shape, ["fp16,residual=0", "int4,sink=4,window=252"], [1024, 131072])
    assert [(r.config, r.seen) for r in rows][:2] == [("none", 1024), ("none", 131072)]
    none = rows[0]
    assert none.bytes == 2 * 30 * 3 * 64 * 1024 * 4 and none.ratio_fp32 == 1.0 and none.ratio_fp16 == 0.5
    fp16 = rows[2]  # no residual: every token in fp16
    assert fp16.ratio_fp16 == 1.0
    bounded = rows[4:]
    assert [r.stored for r in bounded] == [256, 256]
    assert bounded[0].bytes == bounded[1].bytes  # bounded: the same bytes at any length
    recs = memory_records(rows)
    assert [r["config"] for r in recs] == ["none", "fp16,residual=0", "int4,sink=4,window=252"]
    assert recs[2]["lengths"] == [1024, 131072] and recs[2]["stored_tokens"] == [256, 256]


MEMORY_SPECS = [
    "none",
    "fp8",
    "int8",
    "int4",
    "int2,group=64,residual=64",
    "int4,residual=0",
    "q8_0",
    "q4_0",
    "q4_1",
    "int4,k=q8_0,v_group=32",
    "none,sink=4,window=30",
    "int4,sink=4,window=100",
    "q4_0,sink=2,window=60,residual=32",
    "int4,residual=0,sink=4,window=10",
    "int4,residual=0,sink=4,window=50",
    "int4,sink=4,window=140",
    "q4_0,sink=4,window=140",
    "q8_0,group=1,residual=0",
    "fp8,group=8,residual=16,sink=4,window=30",
    "int2,keep_layers=first",  # a layer at another format (the tiny model has 2: first = 0)
    "k4v2,keep_layers=-1,keep_format=int8,sink=4,window=100",
]


@pytest.mark.parametrize("spec", MEMORY_SPECS)
def test_memory_formula_matches_real_cache(model, spec):
    """The formula == the bytes a real SlimCache holds (its stored tensors), after a prefill of 40 tokens
    and single-token steps (fed through the cache's own update, as attention would)."""
    from kvslim import SlimCache

    cfg = parse_spec(spec)
    shape = ModelShape.from_config(model.config, torch.float32)
    cache = SlimCache.from_config(cfg, config=model.config)
    g = torch.Generator().manual_seed(0)

    def feed(n):
        for layer in range(shape.layers):
            k, v = torch.randn(2, 1, shape.kv_heads, n, shape.head_dim, generator=g)
            cache.update(k, v, layer)

    feed(40)
    for t in range(41, 231):
        feed(1)
        if t in (41, 129, 161, 230):
            assert cache_bytes(shape, cfg, t, prefill=40) == (cache.stored_tokens(), cache.live_nbytes()), t
    assert cache.get_seq_length() == 230


def test_cache_bytes_rejects_bad_seen():
    with pytest.raises(ValueError, match="seen"):
        cache_bytes(ModelShape(2, 2, 32), parse_spec("int4"), -1)


# -- the real model (slow) --------------------------------------------------------------------
@pytest.mark.slow
def test_real_model_exactness_and_kl(real_model, text_path):
    model, tok = real_model
    with open(text_path, encoding="utf-8") as f:
        ids = tok(f.read(), return_tensors="pt").input_ids[:, :160]
    ref_ppl = math.exp(float(full_forward_nll(model, ids, prefill=96).mean()))
    report = compare_perplexity(
        model, ids, ["none,sink=4,window=10000", "int4,residual=32"], prefill=96, chunk=1, progress=False
    )
    ref, window, int4 = report.results
    assert abs(ref.ppl / ref_ppl - 1) < 1e-4
    assert window.kld_max == 0.0 and window.top1 == 1.0
    assert 0 < int4.kld_mean < 0.1 and int4.top1 > 0.8


@pytest.mark.slow
def test_real_model_passkey_streaming_limit(real_model):
    """A key far outside a short window is lost; the reference keeps it (SmolLM2 at ~400 tokens)."""
    from kvslim.evaluate import passkey

    model, tok = real_model
    report = passkey(
        model, tok, ["none,sink=4,window=64"], lengths=[400], depths=[0.2], trials=2, progress=False
    )
    ref, window = report.results
    assert ref.accuracy == 1.0
    assert window.accuracy == 0.0
