"""``kvslim eval``: JSON schema, tables, and one-line errors, through ``main(argv)``.

A tiny random llama saved with a small BPE tokenizer (trained in ~0.2 s on an English text) stands in
for the real model, so these run in seconds and offline.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import PPL_KEYS, tiny_model
from kvslim.cli import main

#: A perplexity record: conftest's keys and the bits per element of the cache the text went through.
PPL_RECORD_KEYS = PPL_KEYS | {"bits_per_element", "bits"}
BITS_KEYS = {
    "bits_per_element",
    "tokens_seen",
    "stored_tokens",
    "elements",
    "bytes",
}


@pytest.fixture(scope="module")
def english(text_path) -> str:
    return Path(text_path).read_text(encoding="utf-8")


CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, english):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<unk>", "<eos>", "<bos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator([english], trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<eos>", bos_token="<bos>", unk_token="<unk>"
    )
    tok.chat_template = CHAT_TEMPLATE
    model = tiny_model(
        "llama", vocab_size=len(tok), eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id
    )
    path = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture
def text_file(tmp_path, english):
    f = tmp_path / "text.txt"
    f.write_text(english[:3000])
    return str(f)


def run(capsys, *argv):
    rc = main(["eval", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


# -- errors: one line on stderr, exit 2 -------------------------------------------------------
def test_bad_spec(capsys, text_file):
    rc, out, err = run(capsys, "ppl", "--text", text_file, "--config", "int5")
    assert rc == 2
    assert err.startswith("kvslim: error: ") and "int5" in err and "int4" in err  # names the legal formats
    assert len(err.strip().splitlines()) == 1


def test_bad_spec_key(capsys, text_file):
    rc, _, err = run(capsys, "memory", "--config", "int4,windw=10")
    assert rc == 2 and "windw" in err and "window" in err


def test_missing_text_file(capsys, tmp_path):
    rc, _, err = run(capsys, "ppl", "--text", str(tmp_path / "nope.txt"), "--config", "int4")
    assert rc == 2 and "nope.txt: no such file" in err


def test_empty_text_file(capsys, tmp_path):
    (tmp_path / "e.txt").write_text("  \n")
    rc, _, err = run(capsys, "ppl", "--text", str(tmp_path / "e.txt"))
    assert rc == 2 and "empty" in err


def test_bad_lists(capsys):
    rc, _, err = run(capsys, "passkey", "--depths", "0.5,2")
    assert rc == 2 and "--depths" in err
    rc, _, err = run(capsys, "memory", "--lengths", "1k")
    assert rc == 2 and "--lengths" in err


def test_missing_prompts_file(capsys, tmp_path):
    rc, _, err = run(capsys, "greedy", "--prompts", str(tmp_path / "p.txt"))
    assert rc == 2 and "p.txt: no such file" in err


def test_plot_output_dir_missing(capsys, text_file, tmp_path):
    rc, _, err = run(capsys, "ppl", "--text", text_file, "--plot", str(tmp_path / "no" / "x.png"))
    assert rc == 2 and "does not exist" in err


def test_tokens_larger_than_text(capsys, model_dir, text_file):
    rc, _, err = run(capsys, "ppl", "--model", model_dir, "--text", text_file, "--tokens", "100000")
    assert rc == 2 and "--tokens 100000 is more than the" in err and "text.txt" in err


def test_prefill_not_below_tokens(capsys, model_dir, text_file):
    rc, _, err = run(
        capsys, "ppl", "--model", model_dir, "--text", text_file, "--tokens", "50", "--prefill", "50"
    )
    assert rc == 2 and "--prefill 50" in err


def test_no_subcommand(capsys):
    try:
        rc = main(["eval"])
    except SystemExit as e:  # argparse's own exit, if the dispatcher lets it through
        rc = e.code
    assert rc == 2 and "WHAT" in capsys.readouterr().err


# -- JSON schema --------------------------------------------------------------------------------
def test_ppl_json_table_and_plot(capsys, model_dir, text_file, tmp_path):
    out_json, out_png = tmp_path / "ppl.json", tmp_path / "ppl.png"
    rc, out, err = run(
        capsys,
        *(
            f"ppl --model {model_dir} --text {text_file} --tokens 80 --prefill 16 --chunk 4 --bucket 32 "
            f"--config int4,residual=0 --config none,sink=4,window=1000 --json {out_json} --plot {out_png} "
            "--no-progress"
        ).split(),
    )
    assert rc == 0, err
    data = json.loads(out_json.read_text())
    assert set(data) == {"model", "dtype", "tokens", "prefill", "chunk", "text", "bucket", "results"}
    assert data["tokens"] == 80 and data["prefill"] == 16 and data["model"] == model_dir
    assert data["dtype"] == "float32"
    assert [r["config"] for r in data["results"]] == ["none", "int4,residual=0", "none,sink=4,window=1000"]
    assert all(set(r) == PPL_RECORD_KEYS and set(r["bits"]) == BITS_KEYS for r in data["results"])
    ref, lossy, window = data["results"]
    # after the 79 tokens fed (the 80th is only a target): the fp32 reference at 32 bits; int4 without a
    # residual: sink=auto's 16 first tokens in fp16, then 32 tokens encoded (5 bits at head_dim 32, see
    # test_evaluate) and 31 in fp16 (a group not yet whole)
    assert ref["bits"]["tokens_seen"] == 79 and ref["bits_per_element"] == 32.0
    assert lossy["bits_per_element"] == pytest.approx((32 * 5 + (16 + 31) * 16) / 79)
    assert "bits/elem" in err and "after 79 tokens seen" in err
    assert ref["kld_mean"] == 0.0 and ref["top1"] == 1.0 and ref["ppl_ratio"] == 1.0
    assert window["kld_max"] == 0.0 and window["top1"] == 1.0
    assert lossy["kld_mean"] > 0 and lossy["scored_tokens"] == 64
    assert [(p["start"], p["end"]) for p in ref["curve"]] == [(16, 32), (32, 64), (64, 80)]
    assert set(ref["curve"][0]) == {"start", "end", "ppl", "kld_mean"}
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    lines = out.splitlines()
    assert lines[0].split()[:3] == ["config", "bits/elem", "ppl"] and lines[2].split()[:2] == ["none", "32"]


def test_greedy_json(capsys, model_dir, tmp_path):
    out_json = tmp_path / "g.json"
    rc, out, err = run(
        capsys,
        *(
            f"greedy --model {model_dir} --tokens 6 --config none,sink=2,window=1000 --config int4 "
            f"--json {out_json} --no-progress"
        ).split(),
    )
    assert rc == 0, err
    data = json.loads(out_json.read_text())
    assert set(data) == {"model", "tokens", "results"}
    ref, window, _ = data["results"]
    # short prompts + 6 tokens fit in int4's 128-token residual: the CLI says nothing was quantized
    assert "note: int4:" in err and "nothing was quantized" in err
    assert ref["config"] == "none" and ref["prefix_match_mean"] == 1.0 and window["prefix_match_mean"] == 1.0
    assert set(ref) == {"config", "prefix_match_mean", "bits_per_element", "bits", "prompts"}
    assert ref["bits_per_element"] == 32.0 and window["bits_per_element"] == 32.0
    assert set(ref["prompts"][0]) == {"name", "prefix_match", "matched", "reference_tokens", "prompt_tokens"}
    assert "story" in out and "chat" in out


def test_memory_json(capsys, model_dir, tmp_path):
    out_json = tmp_path / "m.json"
    rc, out, err = run(
        capsys,
        *(
            f"memory --model {model_dir} --lengths 100,1000 --config int4 --config q4_0,sink=4,window=252 "
            f"--json {out_json}"
        ).split(),
    )
    assert rc == 0, err
    data = json.loads(out_json.read_text())
    assert set(data) == {"model", "tokens", "lengths", "dtype", "results"}
    assert data["lengths"] == [100, 1000] and data["tokens"] == 1000
    assert [r["config"] for r in data["results"]] == ["none", "int4", "q4_0,sink=4,window=252"]
    keys = {
        "config",
        "lengths",
        "bytes",
        "stored_tokens",
        "bytes_per_token",
        "bits_per_element",
        "ratio_fp16",
        "ratio_fp32",
    }
    assert all(set(r) == keys for r in data["results"])
    none = data["results"][0]
    per_token = 2 * 2 * 2 * 32 * 4  # K and V, 2 layers, 2 KV heads, head_dim 32, float32
    assert none["bytes"] == [per_token * 100, per_token * 1000] and none["ratio_fp32"] == [1.0, 1.0]
    assert data["results"][2]["stored_tokens"] == [100, 256]
    assert none["bits_per_element"] == [32.0, 32.0] and "bits/elem" in out


def test_passkey_json(capsys, model_dir, tmp_path):
    out_json = tmp_path / "p.json"
    rc, out, err = run(
        capsys,
        *(
            f"passkey --model {model_dir} --lengths 400 --depths 0,1 --trials 1 --config none,sink=4,window=32 "
            f"--json {out_json} --no-progress"
        ).split(),
    )
    assert rc == 0, err
    data = json.loads(out_json.read_text())
    assert set(data) == {"model", "tokens", "lengths", "depths", "trials", "results"}
    ref, window = data["results"]
    assert ref["config"] == "none" and window["config"] == "none,sink=4,window=32"
    assert set(ref) == {"config", "accuracy", "bits_per_element", "bits", "cells"}
    assert ref["bits_per_element"] == 32.0
    assert [(c["length"], c["depth"]) for c in ref["cells"]] == [(400, 0.0), (400, 1.0)]
    assert all(c["tokens"] <= 400 and c["trials"] == 1 for c in ref["cells"])
    assert "400@0" in out


def test_long_json_and_tables(capsys, model_dir, tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("The history of the printing press begins in\nchat:Tell me a story.\n")
    out_json = tmp_path / "long.json"
    rc, out, err = run(
        capsys,
        *(
            f"long --model {model_dir} --prompts {prompts} --tokens 40 --bucket 16 --config int4,residual=0 "
            f"--config none,sink=2,window=1000 --json {out_json} --no-progress"
        ).split(),
    )
    assert rc == 0, err
    data = json.loads(out_json.read_text())
    assert set(data) == {"model", "tokens", "stop_at_eos", "bucket", "prompts", "results"}
    assert data["tokens"] == 40 and data["stop_at_eos"] is False
    assert [p["name"] for p in data["prompts"]] == ["line1", "line2"]
    assert all(p["reference_tokens"] == 40 for p in data["prompts"])
    ref, lossy, window = data["results"]
    assert [r["config"] for r in data["results"]] == ["none", "int4,residual=0", "none,sink=2,window=1000"]
    keys = {
        "config", "bits_per_element", "bits", "diverged", "prompts_run", "divergence_min", "divergence_median",
        "prefix_mean", "match", "kld_mean", "kld_p99", "kld_max", "ref_top1", "ref_ppl", "generated_tokens",
        "curve", "prompts",
    }  # fmt: skip
    assert all(set(r) == keys and set(r["bits"]) == BITS_KEYS for r in data["results"])
    for r in (ref, window):  # the window holds every token: the reference's forwards, exactly
        assert (
            r["diverged"] == 0 and r["divergence_min"] == 40 and r["kld_max"] == 0.0 and r["ref_top1"] == 1.0
        )
        assert all(p["first_divergence"] is None for p in r["prompts"])
    assert ref["bits_per_element"] == 32.0 and lossy["bits_per_element"] < 16.0
    assert lossy["kld_mean"] > 0 and lossy["generated_tokens"] == 80
    assert [(c["start"], c["end"]) for c in lossy["curve"]] == [(0, 16), (16, 32), (32, 40)]
    assert set(lossy["curve"][0]) == {"start", "end", "kld_mean", "ref_top1", "match", "alive"}
    assert set(lossy["prompts"][0]) == {
        "name", "prompt_tokens", "generated", "first_divergence", "matched", "prefix", "position_match",
        "kld_mean", "ref_top1",
    }  # fmt: skip
    lines = out.splitlines()
    assert lines[0].split()[:4] == ["config", "bits/elem", "diverged", "div"] and lines[2].split()[:3] == [
        "none",
        "32",
        "0/2",
    ]
    assert "first divergence" in out and "none" in out
    assert "bits/elem" in err and "KL(reference || mode)" in err


def test_long_bad_tokens(capsys):
    rc, _, err = run(capsys, "long", "--tokens", "0")
    assert rc == 2 and "--tokens" in err
