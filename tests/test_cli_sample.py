"""``kvslim sample`` through ``main(argv)``: user errors as one line, real runs in several cache modes."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("kvslim.cache.adapter", reason="src/kvslim/cache/adapter.py (SlimCache) does not exist yet")

from kvslim import models  # noqa: E402
from kvslim.cli import main  # noqa: E402
from kvslim.textstream import StreamDecoder  # noqa: E402

PROMPT = "The night sky"


def _error(capsys, argv) -> str:
    """Run, expect exit 2 with one 'kvslim: error:' line on stderr and no traceback; return it."""
    code = main(["sample", *argv])
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvslim: error: "), err
    assert "Traceback" not in err
    return lines[0]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--streaming-llm-window", "0"], "window must be >= 1"),
        (["--streaming-llm-sink", "-1", "--streaming-llm-window", "8"], "sink must be >= 0"),
        (["--model", "./no-such-model"], "does not exist"),
        (["--model", "/tmp/kvslim-no-such/model.gguf"], "does not exist"),
        (["--kv-quantize", "int4", "--kv-mean-center", "b.gguf"], "mean_center does not apply to K format"),
        (["--kv-quantize", "q4_0", "--kv-mean-center", "/tmp/kvslim-no-such-bias.gguf"], "no such file"),
        (["--tokens", "0"], "--tokens must be >= 1"),
        (["--temperature", "-1"], "--temperature must be >= 0"),
        (["--top-p", "0"], "--top-p must be in (0, 1]"),
        (["--kv-residual", "100"], "--kv-residual=100 is not a multiple of --kv-group-size=32"),
        (["--report-json", "/tmp/kvslim-no-such-dir/r.json"], "does not exist"),
    ],
)
def test_user_errors_are_one_line(capsys, argv, message):
    assert message in _error(capsys, ["--prompt", PROMPT, *argv])


def test_unknown_format_is_rejected(capsys):
    # argparse's own choices check: one line, exit 2, the legal names listed, no traceback.
    assert main(["sample", "--prompt", PROMPT, "--kv-quantize", "int5"]) == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'int5'" in err and "q4_0" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_no_prompt_and_a_terminal(capsys, monkeypatch, tmp_path):
    """No --prompt and stdin a terminal: one line before anything loads. ``--model`` names a directory, so
    the check of the default model (the embedded package) is not needed; nothing is loaded from it."""

    class Tty:
        def isatty(self):
            return True

    monkeypatch.setattr("sys.stdin", Tty())
    assert "no prompt" in _error(capsys, ["--model", str(tmp_path)])


# ---------------------------------------------------------------------------------------------
# real runs (the session's model, loaded once)


@pytest.fixture
def sample(real_model, monkeypatch, capsys, tmp_path):
    """Run ``kvslim sample`` on the session model; return (exit code, stdout, stderr, report).

    ``kvslim sample`` switches the model to the kvslim attention; the session model is shared, so its
    attention implementation is put back afterwards (other tests compare sdpa paths exactly)."""
    monkeypatch.setattr(models, "load_model", lambda *a, **k: real_model)
    model = real_model[0]
    before = model.config._attn_implementation

    def run(*argv, prompt=PROMPT):
        report = tmp_path / "report.json"
        code = main(["sample", "--prompt", prompt, "--report-json", str(report), *argv])
        out, err = capsys.readouterr()
        return code, out, err, (json.loads(report.read_text()) if report.exists() else None)

    yield run
    model.set_attn_implementation(before)


@pytest.mark.slow
@pytest.mark.parametrize(
    "flags",
    [
        [],
        ["--kv-quantize", "int4", "--streaming-llm-sink", "4", "--streaming-llm-window", "32"],
        ["--kv-quantize", "q4_0", "--kv-residual", "0"],
    ],
    ids=["none", "int4+streaming", "q4_0"],
)
def test_real_model_modes(sample, flags):
    code, out, err, report = sample("--tokens", "6", "--temperature", "0", "--ignore-eos", *flags)
    assert code == 0, err
    lines = err.strip().splitlines()
    assert lines[0].startswith("kvslim sample | model SmolLM2-135M-Instruct (embedded) | cache K ")
    assert "bits/elem" in lines[0] and "cpu float32" in lines[0]
    assert out.strip(), "no text streamed"
    assert "tokens seen" in err and "fp16 full cache" in err and "decode" in err
    n_prompt = report["prompt_tokens"]
    assert report["new_tokens"] == 6 and report["tokens_seen"] == n_prompt + 5
    keys = ("tokens_stored", "cache_bytes", "fp16_full_cache_bytes", "decode_tokens_per_s", "peak_rss_bytes")
    for key in keys:
        assert report[key] is not None and report[key] > 0, key
    assert report["prefill_tokens_per_s"] > 0 and isinstance(report["config"], dict)


@pytest.mark.slow
def test_streaming_stores_sink_plus_window(sample, tmp_path):
    rss = tmp_path / "rss.csv"
    code, out, err, report = sample(
        "--tokens", "14", "--temperature", "0", "--ignore-eos",
        "--streaming-llm-sink", "4", "--streaming-llm-window", "8", "--rss-log", str(rss),
    )  # fmt: skip
    assert code == 0, err
    assert report["tokens_seen"] == report["prompt_tokens"] + 13 > 4 + 8
    assert report["tokens_stored"] == 4 + 8 == report["capacity"]
    assert "cap sink+window = 4+8" in err
    rows = rss.read_text().strip().splitlines()
    assert rows[0] == "step,rss_bytes" and len(rows) >= 3 and int(rows[-1].split(",")[1]) > 0


@pytest.mark.slow
def test_seeded_sampling_is_reproducible(sample):
    c = sample("--tokens", "4", "--temperature", "1.0", "--seed", "7", "--ignore-eos")[1]
    d = sample("--tokens", "4", "--temperature", "1.0", "--seed", "7", "--ignore-eos")[1]
    assert c == d


@pytest.mark.slow
def test_chat_template(sample):
    code, out, err, report = sample("--chat", "--tokens", "4", "--temperature", "0", prompt="Hi")
    assert code == 0, err
    assert report["prompt_tokens"] > 10  # the template's system and role markers


@pytest.mark.slow
def test_beyond_context_is_an_error_or_a_warning(sample):
    code, out, err, report = sample("--tokens", "9000")
    assert code == 2 and "beyond the model's context of 8192" in err and report is None
    assert "--allow-beyond-context" in err and "Traceback" not in err


@pytest.mark.slow
def test_ctrl_c_stops_cleanly_with_a_report(sample, monkeypatch):
    real_push = StreamDecoder.push
    calls = {"n": 0}

    def push(self, token_id):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real_push(self, token_id)

    monkeypatch.setattr(StreamDecoder, "push", push)
    code, out, err, report = sample("--tokens", "50", "--temperature", "0", "--ignore-eos")
    assert code == 130
    assert "interrupted" in err and "tokens seen" in err and "Traceback" not in err
    assert report["interrupted"] is True and report["new_tokens"] == 3


def test_context_policy(capsys):
    import argparse

    from kvslim import CacheConfig
    from kvslim.cli import sample_checks
    from kvslim.cli.common import UserError

    args = argparse.Namespace(tokens=100, allow_beyond_context=False)
    sample_checks.check_context(args, CacheConfig(), prompt_tokens=50, context=200)  # fits
    with pytest.raises(UserError, match="needs 250 positions, beyond the model's context of 200"):
        sample_checks.check_context(args, CacheConfig(), prompt_tokens=150, context=200)
    # StreamingLLM: allowed, silently.
    sample_checks.check_context(args, CacheConfig(sink=4, window=64), prompt_tokens=150, context=200)
    args.allow_beyond_context = True
    sample_checks.check_context(args, CacheConfig(), prompt_tokens=150, context=200)
    assert "warning" in capsys.readouterr().err


def test_prompt_from_stdin_drops_echos_newline(monkeypatch):
    import argparse
    import io

    from kvslim.cli.prompt import read_prompt

    monkeypatch.setattr("sys.stdin", io.StringIO("What is the capital of France?\n"))
    assert read_prompt(argparse.Namespace(prompt=None)) == "What is the capital of France?"
    assert read_prompt(argparse.Namespace(prompt="keep\n")) == "keep\n"
