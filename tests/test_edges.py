# ruff: noqa: F811 - the fixtures imported from test_faults are parameters here
"""Issue 23's bad-input cases, each as a new user met it: what happened before is in each test's
docstring; the test asserts what should happen. The tiny model and helpers are test_faults.py's."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from kvslim import compat
from test_faults import (  # noqa: F401 - fixtures
    _damage,
    _load_embedded,
    embedded,
    long_text,
    model_dir,
    no_model_load,
    one_error_line,
    run_cli,
    tiny,
)

PROMPT = "t3 t4 t5 t6"


# ---------------------------------------------------------------------------------------------
# output paths that are not regular files


@pytest.mark.parametrize("target", ["/dev/null", "regular"])
def test_out_symlink_is_refused_and_kept(capsys, no_model_load, long_text, tmp_path, target):
    """Before: exit 0, "wrote link", the symlink replaced by a regular file."""
    if target == "regular":
        target = tmp_path / "real.gguf"
        target.write_bytes(b"old")
    link = tmp_path / "bias.gguf"
    link.symlink_to(target)
    code, out, err = run_cli(capsys, "calibrate", "--text", long_text, "--out", link)
    line = one_error_line(err)
    assert code == 2 and f"--out {link}: is a symbolic link" in line and "regular file" in line
    assert link.is_symlink() and os.readlink(link) == str(target)


def test_out_device_node_is_refused(capsys, no_model_load, long_text):
    """Before (as root): exit 0, /dev/null replaced by a regular file."""
    code, out, err = run_cli(capsys, "calibrate", "--text", long_text, "--out", "/dev/null")
    assert code == 2 and "--out /dev/null: is not a regular file" in one_error_line(err)
    assert Path("/dev/null").is_char_device()


def test_library_writer_refuses_a_symlink(tmp_path):
    from kvslim.atomic import WriteError, write_text

    (tmp_path / "real.txt").write_text("old")
    (tmp_path / "link.txt").symlink_to(tmp_path / "real.txt")
    with pytest.raises(WriteError, match="is a symbolic link"):
        write_text(tmp_path / "link.txt", "new")
    assert (tmp_path / "link.txt").is_symlink() and (tmp_path / "real.txt").read_text() == "old"


# ---------------------------------------------------------------------------------------------
# sampling at the edges of float precision


@pytest.mark.parametrize(
    ("temperature", "top_p"), [(1e-40, 0.95), (0.7, 1e-300), (1e-300, 1e-300), (5e-324, 1.0)]
)
def test_tiny_temperature_and_top_p_take_the_top_token(temperature, top_p):
    """Before: RuntimeError from torch.multinomial (inf/NaN probabilities, or every token dropped)."""
    from kvslim.generate import sample_next

    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(1)
    assert torch.equal(sample_next(logits, temperature, top_p, g), logits.argmax(dim=-1))


def test_cli_tiny_temperature(capsys, model_dir):
    code, out, err = run_cli(
        capsys, "sample", "--model", model_dir, "--prompt", PROMPT, "--tokens", "4", "--ignore-eos",
        "--temperature", "1e-40", "--top-p", "1e-300", "--seed", "1",
    )  # fmt: skip
    assert code == 0 and "Traceback" not in err and len(out.split()) == 4


# ---------------------------------------------------------------------------------------------
# a WORLD_SIZE left over in the shell


def test_world_size_without_torchrun_says_why(capsys, monkeypatch, no_model_load):
    """Before: exit 2 with no output at all on RANK=1 (even --help printed nothing)."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    code, out, err = run_cli(capsys, "sample", "--prompt", PROMPT)
    line = one_error_line(err)
    assert (
        code == 2
        and "WORLD_SIZE=2 is set but MASTER_ADDR and MASTER_PORT are not" in line
        and "torchrun" in line
    )
    with pytest.raises(SystemExit):
        run_cli(capsys, "sample", "--help")
    assert "usage: kvslim sample" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------
# what the cache says it stores


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        (dict(kv_quantize="none", rotate="kv"), "k_quantize='none' and v_quantize='none'"),
        (dict(kv_quantize="int4", v_quantize="none", rotate="v"), "v_quantize='none'"),
    ],
)
def test_rotation_of_an_unquantized_tensor_is_refused(tiny, kw, message):
    """Before: cache.rotate, report() and the banner claimed a rotation that was not applied."""
    from kvslim import SlimCache

    with pytest.raises(ValueError, match=f"rotate=.* with {message}: only encoded"):
        SlimCache(config=tiny[0].config, **kw)


def test_cli_rotation_of_an_unquantized_tensor(capsys, model_dir):
    code, out, err = run_cli(
        capsys,
        "sample",
        "--model",
        model_dir,
        "--prompt",
        PROMPT,
        "--kv-quantize",
        "none",
        "--kv-rotate",
        "kv",
    )
    assert code == 2 and "only encoded (quantized) tensors are stored rotated" in one_error_line(err)


# ---------------------------------------------------------------------------------------------
# messages that name the culprit


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--streaming-llm-sink", "-1"], "--streaming-llm-sink must be >= 0"),
        (["--streaming-llm-window", "0"], "--streaming-llm-window must be >= 1"),
        (["--kv-group-size", "0"], "--kv-group-size must be >= 1"),
        (["--kv-residual", "33"], "--kv-residual=33 is not a multiple of --kv-group-size=32"),
    ],
)
def test_cli_cache_errors_name_the_flag(capsys, no_model_load, argv, flag):
    """Before: "sink must be >= 0" (the API's name) for --streaming-llm-sink."""
    code, out, err = run_cli(capsys, "sample", "--prompt", PROMPT, *argv)
    assert code == 2 and flag in one_error_line(err)


# ---------------------------------------------------------------------------------------------
# the converted copy, loaded in float16


def test_damaged_copy_is_found_in_float16(embedded):
    """Before: the fingerprint check was skipped for float16, and every run blamed the model's keys."""
    from kvslim.models import converted_dir, model_fingerprint

    gguf, conversions = embedded
    good, _ = _load_embedded()
    _damage(converted_dir(gguf), "overwritten in place")
    model, warned = _load_embedded(dtype=torch.float16)
    assert len(conversions) == 2 and len(warned) == 1 and "is damaged" in warned[0]
    assert model.dtype == torch.float16
    assert model_fingerprint(model.float()) != ""  # usable
    assert torch.equal(model.model.embed_tokens.weight, good.model.embed_tokens.weight.half())


def test_float16_load_of_a_good_copy(embedded):
    gguf, conversions = embedded
    _load_embedded()
    model, warned = _load_embedded(dtype=torch.float16)
    assert model.dtype == torch.float16 and not warned and len(conversions) == 1


# ---------------------------------------------------------------------------------------------
# the first conversion on a full disk


def test_conversion_on_a_full_disk_is_one_line(embedded, monkeypatch):
    """Before: a SafetensorError traceback ("No space left on device" is not an OSError there)."""
    from safetensors import SafetensorError
    from transformers import PreTrainedModel

    def full(self, *a, **k):
        raise SafetensorError("Error while serializing: IoError(Os { code: 28, kind: StorageFull })")

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", full)
    with pytest.raises(ValueError, match="cannot save the converted copy of fake.gguf under .*: SafetensorError: "
                       "Error while serializing.*; free some space or set KVSLIM_CACHE_DIR"):  # fmt: skip
        _load_embedded()


def test_cli_conversion_on_a_full_disk(capsys, embedded, monkeypatch):
    from safetensors import SafetensorError
    from transformers import PreTrainedModel

    def full(self, *a, **k):
        raise SafetensorError("No space left on device (os error 28)")

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", full)
    code, out, err = run_cli(capsys, "sample", "--prompt", PROMPT, "--tokens", "1")
    lines = [line for line in err.splitlines() if line.startswith("kvslim: error")]
    assert code == 2 and "Traceback" not in err and len(lines) == 1 and "free some space" in lines[0]


# ---------------------------------------------------------------------------------------------
# stdout closed or full


def test_closed_stdout_is_an_error(capsys, monkeypatch, no_model_load):
    """Before: `kvslim sample ... >&-` exited 0 and the text went nowhere."""
    monkeypatch.setattr(sys, "stdout", None)
    code, out, err = run_cli(capsys, "sample", "--prompt", PROMPT)
    assert code == 2 and "stdout is closed" in one_error_line(err)


def test_full_stdout_names_stdout(capsys, monkeypatch, model_dir):
    """Before: "[Errno 28] No space left on device", without saying it was stdout."""
    import errno

    class Full:
        def write(self, text):
            raise OSError(errno.ENOSPC, "No space left on device")

        def flush(self):
            pass

    monkeypatch.setattr(sys, "stdout", Full())
    code = __import__("kvslim.cli", fromlist=["main"]).main(
        ["sample", "--model", model_dir, "--prompt", PROMPT, "--tokens", "2", "--ignore-eos"]
    )
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("kvslim: error")]
    assert code == 2 and errors == [
        "kvslim: error: stdout: No space left on device; the text on stdout is incomplete"
    ]


# ---------------------------------------------------------------------------------------------
# eval and calibrate: paths and context checked up front


def test_eval_plot_format_checked_before_the_model_loads(capsys, no_model_load, long_text, tmp_path):
    """Before: the whole evaluation ran, then "Format 'txt' is not supported"."""
    pytest.importorskip("matplotlib")
    code, out, err = run_cli(capsys, "eval", "ppl", "--text", long_text, "--plot", tmp_path / "plot.txt")
    assert code == 2 and "--plot" in one_error_line(err) and "name a .png file" in err


def test_eval_past_the_context_warns(capsys, model_dir, long_text):
    """Before: perplexity past the model's context without a window ran silently."""
    code, out, err = run_cli(
        capsys, "eval", "ppl", "--model", model_dir, "--text", long_text, "--tokens", "80", "--prefill", "70",
        "--config", "int8", "--config", "int8,sink=4,window=16",
    )  # fmt: skip
    assert code == 0, err
    assert "runs past the model's context" not in err  # 80 positions in a 4096 context
    from test_faults import tiny_model  # noqa: F401

    small = Path(model_dir).parent / "ctx64"
    if not small.exists():
        import shutil

        shutil.copytree(model_dir, small)
        cfg = (
            (small / "config.json")
            .read_text()
            .replace('"max_position_embeddings": 4096', '"max_position_embeddings": 64')
        )
        (small / "config.json").write_text(cfg)
    code, out, err = run_cli(
        capsys, "eval", "ppl", "--model", small, "--text", long_text, "--tokens", "80", "--prefill", "70",
        "--config", "int8", "--config", "int8,sink=4,window=16",
    )  # fmt: skip
    warned = [line for line in err.splitlines() if "runs past the model's context of 64" in line]
    assert code == 0 and len(warned) == 1 and "reference and int8 (no --config window)" in warned[0]


def test_calibrate_ctx_past_the_context_is_refused(capsys, model_dir, long_text, tmp_path):
    """Before: `calibrate --ctx 6000` on a 4,096-position model ran silently past it."""
    out = tmp_path / "b.gguf"
    code, _, err = run_cli(
        capsys, "calibrate", "--model", model_dir, "--text", long_text, "--ctx", "6000", "--out", out
    )
    assert code == 2 and "--ctx 6000 is beyond the model's context of 4096" in one_error_line(err)
    assert not out.exists()


def test_non_utf8_prompts_file_names_the_file(capsys, no_model_load, tmp_path):
    """Before: the codec's message, without the file."""
    bad = tmp_path / "prompts.txt"
    bad.write_bytes(b"caf\xe9\n")
    code, out, err = run_cli(capsys, "eval", "greedy", "--prompts", bad)
    assert code == 2 and f"--prompts {bad}: not UTF-8 text" in one_error_line(err)


# ---------------------------------------------------------------------------------------------
# bias files and fingerprints


def test_fingerprints_printed_far_enough_to_differ(tmp_path, tiny):
    """Before: two fingerprints differing after 16 hex digits were printed with identical prefixes."""
    from kvslim import SlimCache
    from kvslim.calibration.biasfile import write_bias_file
    from test_faults import bias_set

    theirs = "sha256:" + "ab" * 8 + "cd" * 24
    ours = "sha256:" + "ab" * 8 + "ef" * 24
    write_bias_file(tmp_path / "b.gguf", bias_set(fingerprint=theirs))
    with pytest.raises(ValueError, match="calibrated for another model") as e:
        SlimCache(
            kv_quantize="q4_0", mean_center=tmp_path / "b.gguf", config=tiny[0].config, model_fingerprint=ours
        )
    assert "sha256:" + "ab" * 8 + "cdcd" in str(e.value) and "sha256:" + "ab" * 8 + "efef" in str(e.value)


def test_float16_fingerprint_mismatch_names_the_dtype(capsys, model_dir, long_text, tmp_path):
    """Before: "calibrated for another model" for the same model calibrated in float32, used in float16."""
    bias = tmp_path / "b.gguf"
    assert run_cli(capsys, "calibrate", "--model", model_dir, "--text", long_text, "--ctx", "512",
                   "--out", bias, "--no-progress")[0] == 0  # fmt: skip
    code, out, err = run_cli(
        capsys, "sample", "--model", model_dir, "--prompt", PROMPT, "--tokens", "1", "--dtype", "float16",
        "--kv-quantize", "q4_0", "--kv-mean-center", bias,
    )  # fmt: skip
    line = one_error_line(err)
    assert code == 2 and "calibrated for another model" in line and "this model runs in float16" in line


# ---------------------------------------------------------------------------------------------
# the Python API


def test_update_layer_index_and_empty_first_update(tiny):
    """Before: layer_idx=-1 wrote the last layer; a first update with 0 tokens leaked torch.cat's message."""
    from kvslim import SlimCache

    cache = SlimCache(config=tiny[0].config)
    k = torch.randn(1, 2, 3, 32)
    for bad in (-1, 2, 1.0, True):
        with pytest.raises(ValueError, match="layer_idx"):
            cache.update(k, k, bad)
    with pytest.raises(
        ValueError, match=r"the first update of layer 0 has no tokens \(key_states \(1, 2, 0, 32\)\)"
    ):
        cache.update(k[:, :, :0], k[:, :, :0], 0)
    assert cache.get_seq_length() == 0
    cache.update(k, k, 1)
    assert cache.layers[1].get_seq_length() == 3 and cache.layers[0].get_seq_length() == 0


def test_enable_none_and_bad_devices():
    """Before: enable(None) raised AttributeError; device="meta" returned a meta model; "banana" a RuntimeError."""
    import kvslim
    from kvslim.models import load_model

    with pytest.raises(ValueError, match="needs a loaded transformers model"):
        kvslim.enable(None)
    with pytest.raises(ValueError, match="device 'banana' is not a torch device"):
        load_model("/nonexistent-but-never-read", device="banana")
    with pytest.raises(ValueError, match="device 'meta' holds no weights"):
        load_model("/nonexistent-but-never-read", device="meta")


# ---------------------------------------------------------------------------------------------
# transformers' Cache API (issue 23, item 2)


@pytest.mark.parametrize(
    "spec", [dict(), dict(kv_quantize="int4", residual=0, group_size=1), dict(kv_quantize="q8_0")]
)
def test_layer_keys_values_and_iteration_as_dynamic_cache(tiny, spec):
    """Before: layer.keys / layer.values were None after an update, and SlimCache was not iterable."""
    from transformers import DynamicCache

    from kvslim import SlimCache

    model = tiny[0]
    ids = torch.randint(3, 120, (1, 20), generator=torch.Generator().manual_seed(0))
    dyn, slim = DynamicCache(config=model.config), SlimCache(config=model.config, **spec)
    with torch.no_grad():
        model(ids, **compat.cache_kwargs(dyn), use_cache=True)
        model(ids, **compat.cache_kwargs(slim), use_cache=True)
    assert len(list(slim)) == len(slim) == 2
    for (dk, dv, _), (sk, sv, _) in zip(dyn, slim, strict=True):
        assert sk.shape == dk.shape and sv.shape == dv.shape and sk.dtype == dk.dtype
        if not spec:  # identity: the real values
            assert torch.equal(sk, dk) and torch.equal(sv, dv)
        else:  # lossy: a decoded view, close
            assert (sk - dk).abs().max() < 0.5 * dk.abs().max() and not torch.equal(sk, dk)
    assert SlimCache(config=model.config).layers[0].keys is None  # before any update
    with pytest.raises(AttributeError, match="cannot be assigned"):
        slim.layers[0].keys = torch.zeros(1)


def test_is_croppable_is_honest(tiny):
    """Before: True where a crop would be refused (residual 0: assisted decoding crashed mid-run)."""
    from kvslim import SlimCache

    model = tiny[0]
    ids = torch.randint(3, 120, (1, 20), generator=torch.Generator().manual_seed(0))
    cases = {
        "identity": (dict(), True),
        "identity, residual 0": (dict(residual=0, group_size=1), True),
        "int4 with a residual": (dict(kv_quantize="int4"), True),
        "int4, residual 0": (dict(kv_quantize="int4", residual=0, group_size=1), False),
        "a window": (dict(window=8), False),
    }
    for name, (spec, expected) in cases.items():
        cache = SlimCache(config=model.config, **spec)
        with torch.no_grad():
            model(ids, **compat.cache_kwargs(cache), use_cache=True)
        assert cache.is_croppable is expected, name
        if expected:
            cache.crop(-3)
            assert cache.get_seq_length() == 17, name
        else:
            with pytest.raises(ValueError, match="cannot crop"):
                cache.crop(-3)


def test_assisted_decoding_refused_up_front(tiny):
    """Before: "cannot crop 1 tokens" mid-run with a disagreeing draft."""
    from conftest import tiny_model
    from kvslim import SlimCache

    model, draft = tiny[0], tiny_model("llama", seed=7)
    ids = torch.randint(3, 120, (1, 8), generator=torch.Generator().manual_seed(0))
    cache = SlimCache(kv_quantize="int4", residual=0, group_size=1, config=model.config)
    with pytest.raises(ValueError, match="Assisted decoding requires a cache that can be cropped"):
        model.generate(
            ids, **compat.cache_kwargs(cache), assistant_model=draft, max_new_tokens=6, do_sample=False
        )


def test_offloading_refused_in_one_line(tiny):
    """Before: offloading= was an unexpected keyword, and the layers' offload()/prefetch() did nothing."""
    from kvslim import SlimCache

    with pytest.raises(ValueError, match="offloading=True: SlimCache does not offload"):
        SlimCache(offloading=True)
    layer = SlimCache(config=tiny[0].config).layers[0]
    for call in (layer.offload, layer.prefetch):
        with pytest.raises(ValueError, match="does not offload"):
            call()


def test_bench_threads_bounded(capsys, no_model_load):
    """Before: "cannot load the model ... can't start new thread", then SIGSEGV."""
    code, out, err = run_cli(capsys, "bench", "--threads", "100000", "--smoke")
    line = one_error_line(err)
    assert code == 2 and "--threads 100000 is more than 4 per CPU" in line


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__]))
