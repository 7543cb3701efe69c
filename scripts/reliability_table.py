"""Regenerate the table of docs/reliability.md: run every failure case of issue #16 through the real
``kvslim`` command (a subprocess each, as a user would) and print what it gets: exit code and stderr.

usage: python scripts/reliability_table.py > table.md      (a few minutes; root adds the tmpfs cases)

Uses a tiny random llama saved with a word-level tokenizer (offline), and for the converted-copy
cases a copy of the embedded model's converted copy (convert it once first: `kvslim sample ...`).
"""

from __future__ import annotations

import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PY = sys.executable
KVSLIM = [PY, "-c", "import sys; from kvslim.cli import main; sys.exit(main(sys.argv[1:]))"]
ROWS: list[tuple[str, str, str, str]] = []


def env(**extra) -> dict:
    e = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    e.update(extra)
    return e


def show(args: list) -> str:
    text = " ".join(str(a) for a in args)
    return text.replace(str(WORK), "$W")


def stderr_cell(err: str) -> str:
    lines = [
        line for line in err.splitlines() if line.strip() and not line.startswith(("Loading", "Writing"))
    ]
    keep = [
        line for line in lines if line.startswith(("kvslim: error", "kvslim: warning", "Traceback"))
    ] or lines[-2:]
    text = " / ".join(keep)[:400].replace("|", "\\|").replace(str(WORK), "$W")
    return f"`{text}`" if text else "(nothing)"


def run(case: str, args: list, *, stdin: bytes | None = None, preexec=None, cmd_note: str = "", **kw) -> None:
    res = subprocess.run(
        KVSLIM + [str(a) for a in args],
        input=stdin,
        capture_output=True,
        env=env(**kw),
        preexec_fn=preexec,
        timeout=600,
    )
    err = res.stderr.decode("utf-8", "replace")
    ROWS.append((case, "`kvslim " + (cmd_note or show(args)) + "`", str(res.returncode), stderr_cell(err)))


def signal_case(case: str, args: list, sig: int, *, wait_for: str, delay: float) -> None:
    proc = subprocess.Popen(
        KVSLIM + [str(a) for a in args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env()
    )
    if wait_for:
        while wait_for not in proc.stderr.readline().decode():
            pass
    time.sleep(delay)
    proc.send_signal(sig)
    err = proc.stderr.read().decode()
    rc = proc.wait(timeout=120)
    note = (
        f"{show(args)}` + {signal.Signals(sig).name} {'after the banner' if wait_for else 'during imports'}"
    )
    ROWS.append(
        (
            case,
            "`kvslim " + note,
            str(rc),
            stderr_cell(err) + (" + the report" if "tokens seen" in err else ""),
        )
    )


def tiny_model_dir(path: Path) -> str:
    import torch
    import transformers as tf
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers import models as tok_models

    torch.manual_seed(0)
    config = tf.LlamaConfig(
        vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=4096, pad_token_id=0, eos_token_id=1, bos_token_id=2,
    )  # fmt: skip
    tf.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tok = Tokenizer(tok_models.WordLevel({f"t{i}": i for i in range(128)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tf.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="t1", bos_token="t2", unk_token="t0"
    ).save_pretrained(path)
    return str(path)


def mount(path: Path, options: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        return False
    return (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True
        ).returncode
        == 0
    )


def main() -> None:
    global WORK
    WORK = Path(tempfile.mkdtemp(prefix="kvslim-reliability-"))
    m = tiny_model_dir(WORK / "tiny")
    text = WORK / "text.txt"
    text.write_text(" ".join(f"t{3 + i % 120}" for i in range(600)))
    calib = ["calibrate", "--model", m, "--text", text]
    sample = ["sample", "--model", m, "--prompt", "t5 t6 t7", "--tokens", "3"]
    mounts = []

    # 1. failed writes
    good = WORK / "bias.gguf"
    run("calibrate, first write", [*calib, "--out", good])

    # `ulimit -f 12` on SmolLM2's 90 KiB bias; the tiny model's is 1 KiB, so the limit here is 512 bytes
    run("calibrate over a good file under a file-size limit below the new file's size",
        [*calib, "--out", good], preexec=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (512, resource.RLIM_INFINITY)),
        cmd_note=f"{show([*calib, '--out', good])}` under `ulimit -f 0.5")  # fmt: skip
    disk = WORK / "tiny-disk"
    if mount(disk, "size=12k"):
        mounts.append(disk)
        run("calibrate onto a 12 KiB tmpfs, first write", [*calib, "--out", disk / "bias.gguf"])
        try:
            with open(disk / "filler", "wb") as f:
                while True:
                    f.write(b"\0" * 256)
                    f.flush()
        except OSError:  # full
            pass
        run("calibrate over that file, the tmpfs now full", [*calib, "--out", disk / "bias.gguf"])
        run("sample --report-json on the full tmpfs", [*sample, "--report-json", disk / "r.json"])
        run("eval ppl --json on the full tmpfs",
            ["eval", "ppl", "--model", m, "--text", text, "--tokens", "24", "--prefill", "8", "--config", "int4",
             "--no-progress", "--json", disk / "e.json"])  # fmt: skip
    else:
        ROWS.append(("12 KiB tmpfs cases", "(needs root to mount)", "-", "skipped"))

    # 3. bias files
    other = WORK / "other"
    shutil.copytree(m, other)
    import torch
    import transformers as tf

    torch.manual_seed(1)
    tf.AutoModelForCausalLM.from_config(tf.AutoConfig.from_pretrained(m)).save_pretrained(other)
    run(
        "calibrate another model with the same shapes",
        [*calib[:2], other, *calib[3:], "--out", WORK / "other.gguf"],
    )
    q = [*sample, "--kv-quantize", "q4_0", "--kv-mean-center", WORK / "other.gguf"]
    run("a bias file from another model", q)
    run("... with the override", [*q, "--kv-mean-center-any-model"])
    import numpy as np
    from gguf import GGUFWriter

    def fork_like(path: Path, names: list[str], value: float = 0.0) -> Path:
        w = GGUFWriter(str(path), arch="")
        w.add_string("general.type", "kv-mean-center")
        w.add_bool("kv_mean_center.k_rot", False)
        for name in names:
            w.add_tensor(name, np.full(64, value, np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return path

    alias = fork_like(WORK / "alias.gguf", ["kv_bar.blk.0.k", "kv_bar.blk.1.k", "kv_bar.blk.01.k"])
    run("an alias tensor name kv_bar.blk.01.k", [*sample, "--kv-quantize", "q4_0", "--kv-mean-center", alias])
    huge = fork_like(WORK / "huge.gguf", ["kv_bar.blk.0.k", "kv_bar.blk.1.k"], 1e7)
    run("a bias larger than q4_0 can hold", [*sample, "--kv-quantize", "q4_0", "--kv-mean-center", huge])
    fork = fork_like(WORK / "fork.gguf", ["kv_bar.blk.0.k", "kv_bar.blk.1.k"], 0.5)
    run(
        "a fork file (llama.cpp's channel order), llama model",
        [*sample, "--kv-quantize", "q4_0", "--kv-mean-center", fork],
    )
    trunc = WORK / "trunc.gguf"
    trunc.write_bytes(good.read_bytes()[:300])
    run("a truncated bias file", [*sample, "--kv-quantize", "q4_0", "--kv-mean-center", trunc])

    # 4. tracebacks that were
    run("non-UTF-8 prompt on stdin", ["sample", "--model", m], stdin=b"caf\xe9\n")
    ROWS.append(
        (
            "non-UTF-8 --prompt",
            "see tests/test_faults.py::test_cli_non_utf8_prompt_argument",
            "2",
            "`kvslim: error: --prompt is not UTF-8 text (byte 0xe9 at character 3)`",
        )
    )
    bad = WORK / "bad-config"
    shutil.copytree(m, bad)
    (bad / "config.json").write_text("{not json")
    run("--model DIR with a broken config.json", [*sample[:1], "--model", bad, *sample[3:]])
    nw = WORK / "no-weights"
    shutil.copytree(m, nw, ignore=shutil.ignore_patterns("*.safetensors"))
    run("--model DIR with a config but no weights", [*sample[:1], "--model", nw, *sample[3:]])
    from kvslim.models import converted_dir, embedded_gguf_path

    t4k = WORK / "truncated.gguf"
    t4k.write_bytes(embedded_gguf_path().read_bytes()[:4096])
    run("--model a 4 KB truncated GGUF", [*sample[:1], "--model", t4k, *sample[3:]])
    for dev in ("mps", "xpu", "meta"):
        run(f"--device {dev} on a CPU machine", [*sample, "--device", dev])
    ro = WORK / "ro-cache"
    if mount(ro, "size=64k,ro"):
        mounts.append(ro)
        run("read-only cache directory (EROFS), embedded model not converted there",
            ["sample", "--prompt", "hi", "--tokens", "1"], KVSLIM_CACHE_DIR=str(ro))  # fmt: skip
    signal_case(
        "SIGINT while imports are still running",
        ["sample", "--prompt", "x"],
        signal.SIGINT,
        wait_for="",
        delay=1.0,
    )
    signal_case(
        "SIGTERM while generating",
        [*sample[:-1], "3000", "--ignore-eos"],
        signal.SIGTERM,
        wait_for="kvslim sample |",
        delay=0.3,
    )
    proc = subprocess.Popen(
        KVSLIM + [*sample[:-1], "3000", "--ignore-eos"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env(),
    )
    proc.stdout.read(10)
    proc.stdout.close()
    ROWS.append(
        (
            "stderr into a closed pipe",
            f"`kvslim {show([*sample[:-1], '3000', '--ignore-eos'])} 2>&1 \\| head -c 10`",
            str(proc.wait()),
            "(nothing can be shown)",
        )
    )

    # 5. the converted copy (a copy of the embedded model's, damaged)
    src = converted_dir(embedded_gguf_path())
    if (src / "kvslim-source.json").is_file():
        for how in (
            "truncated safetensors",
            "config.json deleted",
            "bytes overwritten in place",
            "bytes overwritten, --verify",
        ):
            cache = WORK / f"cache-{len(ROWS)}"
            dst = cache / "models" / src.name
            shutil.copytree(src, dst)
            weights = dst / "model.safetensors"
            if how.startswith("truncated"):
                os.truncate(weights, weights.stat().st_size // 2)
            elif how.startswith("config"):
                (dst / "config.json").unlink()
            else:
                with open(weights, "r+b") as f:
                    f.seek(weights.stat().st_size // 2)
                    f.write(b"\x7f" * (1 << 20))
            extra = ["--verify"] if how.endswith("--verify") else []
            run(f"converted copy: {how}",
                ["sample", "--prompt", "hi", "--tokens", "2", "--temperature", "0", *extra], KVSLIM_CACHE_DIR=str(cache))  # fmt: skip
    else:
        ROWS.append(("converted copy cases", "(convert the embedded model first)", "-", "skipped"))

    # 6. smaller ones
    run(
        "a group larger than the run",
        [*sample, "--kv-quantize", "int4", "--kv-group-size", "1000000000", "--kv-residual", "0"],
    )
    run("--seed 1e23", [*sample, "--seed", "1e23"])
    run("--seed 10^23", [*sample, "--seed", str(10**23)])
    run("eval ppl --tokens 1", ["eval", "ppl", "--model", m, "--text", text, "--tokens", "1"])
    run("an output path that is a directory", [*calib, "--out", WORK])
    five = WORK / "five.txt"
    five.write_text("t5 t6 t7 t8 t9")
    run("calibrate on a 5-token text", [*calib[:3], "--text", five, "--out", WORK / "five.gguf"])

    # 7. kernel build directory (bench uses the C kernels through the kvslim attention)
    bench = [
        "bench",
        "--smoke",
        "--model",
        m,
        "--no-append",
        "--no-seen",
        "--quiet",
        "--config",
        "q4_0,residual=0",
        "--attn",
        "kvslim",
    ]
    kro = WORK / "kernel-ro"
    if mount(kro, "size=64k"):
        mounts.append(kro)
        (kro / "kernels").mkdir(mode=0o700)
        subprocess.run(["mount", "-o", "remount,ro", str(kro)], check=True)
        run("read-only kernel cache (a warning, the C kernels still used)", bench, KVSLIM_CACHE_DIR=str(kro))
    foreign = WORK / "foreign-cache"
    (foreign / "kernels").mkdir(parents=True)
    if os.geteuid() == 0:
        os.chown(foreign / "kernels", 65534, 65534)
        run("kernel cache owned by another user", bench, KVSLIM_CACHE_DIR=str(foreign))

    # issue 23: unusual input
    link = WORK / "link.gguf"
    link.symlink_to("/dev/null")
    run("issue 23: calibrate --out a symlink (to /dev/null)", [*calib, "--out", link])
    run("issue 23: calibrate --out a device node", [*calib, "--out", "/dev/null"])
    run("issue 23: calibrate --ctx past the model's context", [*calib, "--ctx", "6000", "--out", WORK / "c.gguf"])
    run("issue 23: temperature and top-p below float precision", [*sample, "--temperature", "1e-40", "--top-p", "1e-300"])
    run("issue 23: bench --threads 100000", ["bench", "--smoke", "--model", m, "--threads", "100000"])
    run("issue 23: WORLD_SIZE=2 RANK=1 outside torchrun", sample, WORLD_SIZE="2", RANK="1", cmd_note=f"{show(sample)}` with `WORLD_SIZE=2 RANK=1")
    run("issue 23: a rotation of unquantized K/V", [*sample, "--kv-quantize", "none", "--kv-rotate", "kv"])
    run("issue 23: eval ppl --plot plot.txt", ["eval", "ppl", "--model", m, "--text", text, "--plot", WORK / "plot.txt"])
    run("issue 23: stdout closed", sample, preexec=lambda: os.close(1), cmd_note=f"{show(sample)} >&-")
    run("issue 23: a cache flag out of range", [*sample, "--streaming-llm-sink", "-1"])
    latin1 = WORK / "prompts.txt"
    latin1.write_bytes(b"caf\xe9\n")
    run("issue 23: a non-UTF-8 --prompts file", ["eval", "greedy", "--model", m, "--prompts", latin1])
    fp32 = WORK / "fp32.gguf"
    run("issue 23: calibrate in float32", [*calib, "--out", fp32])
    run(
        "issue 23: that file with --dtype float16",
        [*sample, "--dtype", "float16", "--kv-quantize", "q4_0", "--kv-mean-center", fp32],
    )

    for path in mounts:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)
    print("| case | command | exit | stderr (errors and warnings; `$W` = a temporary directory) |")
    print("|---|---|---|---|")
    for case, cmd, rc, err in ROWS:
        print(f"| {case} | {cmd} | {rc} | {err} |")
    shutil.rmtree(WORK, ignore_errors=True)


WORK = Path(".")
if __name__ == "__main__":
    main()
