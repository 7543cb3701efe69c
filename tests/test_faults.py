"""Fault injection: nothing lost, nothing half-done, one line for every error.

- writes that fail midway (a monkeypatched writer, a file-size limit, a 12 KiB tmpfs where the test
  may mount one): the old file is intact, no temporary is left, the error is one line;
- a bias-file fuzz corpus built here: truncations at many offsets, random bytes, every malformed
  field, forged lengths, alias and duplicate tensor names, a file in llama.cpp's channel order made
  by an independent writer; the model fingerprint and the bias magnitude checked at load;
- the CLI error table: exit code, exactly one ``kvslim: error:`` line, no traceback;
- the converted model copy damaged in each way the issue lists, and re-converted;
- the kernel build directory: read-only, foreign-owned, writable by others, stale temporaries, a
  lock so that concurrent first uses compile once.

Tiny random models only (a 2-layer llama saved with a word-level tokenizer); a few cases run
``kvslim`` in a subprocess (signals, closed pipes, a fresh import).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import json
import os
import resource
import shutil
import signal
import struct
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import save_tiny_word_model, tiny_model
from kvslim import atomic
from kvslim.atomic import AtomicFile, WriteError, write_json
from kvslim.calibration.biasfile import read_bias_file, read_layers, write_bias_file
from kvslim.calibration.meancenter import BiasSet, load_mean_center
from kvslim.cli import main

H, D, L = 2, 32, 2  # tiny_model: 2 layers, 2 KV heads, head_dim 32
PYTHON = sys.executable
SRC = str(Path(__file__).resolve().parent.parent / "src")


def sha256(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def no_temporaries(directory) -> bool:
    return not [p for p in Path(directory).iterdir() if atomic.TMP_TAG in p.name]


def one_error_line(err: str) -> str:
    """The single stderr line of a failed run (asserting there is exactly one, and no traceback)."""
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err, err
    assert len(lines) == 1 and lines[0].startswith("kvslim: error: "), err
    return lines[0]


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def bias_set(scale: float = 1.0, fingerprint: str | None = "sha256:" + "ab" * 32, heads: int = H) -> BiasSet:
    g = torch.Generator().manual_seed(0)
    return BiasSet(
        tensors=[torch.randn(heads, D, generator=g) * scale for _ in range(L)],
        model_fingerprint=fingerprint,
        cache_type="q4_0",
        n_tokens=1024,
        ctx=512,
        n_chunks=2,
    )


# ---------------------------------------------------------------------------------------------
# fixtures: a tiny model on disk, a tiny tmpfs


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    """A 2-layer random llama with a word-level tokenizer (every whitespace-separated word is a
    token), saved as a transformers directory."""
    return str(save_tiny_word_model(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="module")
def tiny(model_dir):
    """(model, tokenizer) loaded from model_dir."""
    from kvslim.models import load_model

    return load_model(model_dir)


def _mount(path: Path, options: str) -> str | None:
    """Mount a tmpfs at ``path``; None on success, else why not (for a skip reason)."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "mounting a tmpfs needs root"
    if shutil.which("mount") is None:
        return "no mount command"
    path.mkdir(parents=True, exist_ok=True)
    res = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True, text=True
    )
    return None if res.returncode == 0 else f"mount failed: {res.stderr.strip()}"


@contextlib.contextmanager
def tmpfs(path: Path, options: str):
    why = _mount(path, options)
    if why is not None:
        pytest.skip(why)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


@pytest.fixture
def tiny_disk(tmp_path):
    """A 12 KiB tmpfs (skipped with the reason where it cannot be mounted)."""
    with tmpfs(tmp_path / "tiny", "size=12k,mode=0755") as path:
        yield path


def fill(directory: Path) -> None:
    """Fill a (tiny) file system to the last byte."""
    with contextlib.suppress(OSError), open(directory / "filler", "wb") as f:
        while True:
            f.write(b"\0" * 512)
            f.flush()


@contextlib.contextmanager
def file_size_limit(nbytes: int):
    """``ulimit -f``: writes past ``nbytes`` fail with EFBIG (Python ignores SIGXFSZ)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


# ---------------------------------------------------------------------------------------------
# 1. atomic writes


def test_atomic_write_failing_midway_keeps_the_old_file(tmp_path, monkeypatch):
    """A GGUF writer that dies half way (ENOSPC) leaves the good file and no temporary."""
    from gguf import GGUFWriter

    target = tmp_path / "bias.gguf"
    write_bias_file(target, bias_set())
    good = sha256(target)

    def half_then_enospc(self, *a, **k):
        for fout in self.fout:
            fout.write(b"\x01" * 100)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(GGUFWriter, "write_tensors_to_file", half_then_enospc)
    with pytest.raises(WriteError) as e:
        write_bias_file(target, bias_set(scale=2.0))
    assert "\n" not in str(e.value) and "No space left on device (ENOSPC)" in str(e.value)
    assert "the existing file is unchanged" in str(e.value)
    assert sha256(target) == good and no_temporaries(tmp_path)


def test_truncated_write_that_reports_success_is_caught_by_the_check(tmp_path, monkeypatch):
    """A writer that silently writes only part of the tensors: the re-read before the rename fails."""
    from gguf import GGUFWriter

    real = GGUFWriter.write_tensors_to_file
    target = tmp_path / "bias.gguf"
    write_bias_file(target, bias_set())
    good = sha256(target)

    def silent_truncation(self, *a, **k):
        real(self, *a, **k)
        for fout in self.fout:
            fout.flush()
            fout.truncate(fout.tell() - 64)

    monkeypatch.setattr(GGUFWriter, "write_tensors_to_file", silent_truncation)
    with pytest.raises(WriteError, match="cannot write bias file .*not a readable GGUF file"):
        write_bias_file(target, bias_set(scale=2.0))
    assert sha256(target) == good and no_temporaries(tmp_path)


def test_file_size_limit(tmp_path):
    """``ulimit -f 12``: the new file (32 KiB) cannot be written whole; the old one survives."""
    target = tmp_path / "bias.gguf"
    write_bias_file(target, bias_set())
    good = sha256(target)
    big = BiasSet(tensors=[torch.ones(64, D)] * 4)  # 4 layers x 8 KiB
    # numpy's tofile reports the short write itself ("... requested and ... written"), others EFBIG
    with file_size_limit(12 * 1024), pytest.raises(WriteError, match="the existing file is unchanged") as e:
        write_bias_file(target, big)
    assert "\n" not in str(e.value)
    assert sha256(target) == good and no_temporaries(tmp_path)


def test_full_tmpfs_bias_file(tiny_disk):
    target = tiny_disk / "bias.gguf"
    write_bias_file(target, bias_set())  # ~1 KiB fits
    good = sha256(target)
    big = BiasSet(tensors=[torch.ones(64, D)] * 4)
    with pytest.raises(
        WriteError, match=r"(No space left on device|short write).*; the existing file is unchanged"
    ):
        write_bias_file(target, big)
    assert sha256(target) == good and no_temporaries(tiny_disk)


def test_atomic_json_and_log(tmp_path, monkeypatch):
    target = tmp_path / "r.json"
    write_json(target, {"a": 1})
    with pytest.raises(ValueError, match="Out of range float"):  # strict JSON: NaN refused, not written
        write_json(target, {"a": float("nan")})
    assert json.loads(target.read_text()) == {"a": 1}

    log = AtomicFile(tmp_path / "log.csv")
    log.write("step,rss\n")
    assert not (tmp_path / "log.csv").exists()  # nothing at the target until the commit
    log.commit()
    assert (tmp_path / "log.csv").read_text() == "step,rss\n" and no_temporaries(tmp_path)

    def enospc(*a, **k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(atomic, "_finish", enospc)
    with pytest.raises(WriteError, match="cannot write output .*r.json: No space left"):
        write_json(target, {"a": 2})
    log = AtomicFile(tmp_path / "log.csv")
    log.write("x\n")
    with pytest.raises(WriteError):
        log.commit()
    assert json.loads(target.read_text()) == {"a": 1} and (tmp_path / "log.csv").read_text() == "step,rss\n"
    assert no_temporaries(tmp_path)


def test_atomic_write_keeps_permissions_and_refuses_directories(tmp_path):
    target = tmp_path / "out.json"
    write_json(target, [1])
    os.chmod(target, 0o640)
    write_json(target, [2])
    assert (target.stat().st_mode & 0o777) == 0o640
    with pytest.raises(WriteError, match="is a directory"):
        write_json(tmp_path, [3])
    with pytest.raises(WriteError, match="does not exist"):
        write_json(tmp_path / "no" / "x.json", [3])


# ---------------------------------------------------------------------------------------------
# 3. the bias file: an independent writer, a fuzz corpus, malformed fields


def gguf_bytes(kvs: list[tuple[str, int, bytes]], tensors: list[tuple[str, list[int], int, bytes]]) -> bytes:
    """A GGUF v3 file written by hand (struct only, not gguf-py): ``kvs`` as (key, value type, packed
    value), ``tensors`` as (name, ne, ggml type, data bytes); data aligned to 32 bytes. It can write
    what gguf-py refuses to (duplicate names, forged lengths)."""

    def string(s: str | bytes) -> bytes:
        b = s.encode() if isinstance(s, str) else s
        return struct.pack("<Q", len(b)) + b

    head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kvs))
    for key, vtype, value in kvs:
        head += string(key) + struct.pack("<I", vtype) + value
    offset, infos, blobs = 0, b"", b""
    for name, ne, ttype, data in tensors:
        infos += string(name) + struct.pack("<I", len(ne)) + b"".join(struct.pack("<Q", n) for n in ne)
        infos += struct.pack("<IQ", ttype, offset)
        pad = (-len(data)) % 32
        blobs += data + b"\0" * pad
        offset += len(data) + pad
    body = head + infos
    return body + b"\0" * ((-len(body)) % 32) + blobs


def kv_str(key: str, value: str) -> tuple[str, int, bytes]:
    b = value.encode()
    return key, 8, struct.pack("<Q", len(b)) + b


def kv_u32(key: str, value: int) -> tuple[str, int, bytes]:
    return key, 4, struct.pack("<I", value)


def kv_i64(key: str, value: int) -> tuple[str, int, bytes]:
    return key, 11, struct.pack("<q", value)


def kv_bool(key: str, value: bool) -> tuple[str, int, bytes]:
    return key, 7, struct.pack("<?", value)


def f32_tensor(name: str, values: np.ndarray) -> tuple[str, list[int], int, bytes]:
    values = np.ascontiguousarray(values, dtype=np.float32)
    return name, [values.size], 0, values.tobytes()


def fork_file(tensors: dict[int, np.ndarray], extra_kvs=(), extra_tensors=()) -> bytes:
    """A file in the fork's layout (general.type, schema_version, model_sha256 = its GGUF-file hash,
    k_rot; 1-D tensors), by the hand writer."""
    kvs = [
        kv_str("general.type", "kv-mean-center"),
        kv_u32("kv_mean_center.schema_version", 1),
        kv_str("kv_mean_center.model_sha256", "0123456789abcdef" * 4),
        kv_bool("kv_mean_center.k_rot", False),
        *extra_kvs,
    ]
    return gguf_bytes(
        kvs, [f32_tensor(f"kv_bar.blk.{il}.k", t) for il, t in tensors.items()] + list(extra_tensors)
    )


def load(path, **kw):
    kw.setdefault("model_type", "llama")
    return load_mean_center(path, n_layers=L, n_kv_heads=H, head_dim=D, **kw)


def test_hand_writer_agrees_with_gguf_py(tmp_path):
    t = {il: np.arange(H * D, dtype=np.float32) + il for il in range(L)}
    (tmp_path / "f.gguf").write_bytes(fork_file(t))
    layers, meta = read_layers(tmp_path / "f.gguf")
    assert sorted(layers) == [0, 1] and np.array_equal(layers[1], t[1])
    assert meta["model_fingerprint"] is None and meta["k_rot"] is False


def llama_cpp_permute(rows: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's ``LlamaModel.permute`` of q/k rows (transformers -> llama.cpp order),
    written out independently of kvslim."""
    return (
        rows.reshape(n_head, 2, rows.shape[0] // n_head // 2, *rows.shape[1:])
        .swapaxes(1, 2)
        .reshape(rows.shape)
    )


def test_fork_file_in_llama_cpp_order_is_converted(tmp_path):
    """A bias of a llama model, in llama.cpp's K channel order (the converter's permutation applied to
    the bias as to k_proj's rows), written by the hand writer with no channel_order key, as the fork's
    tool writes it: kvslim converts it for a llama model and leaves it for a NEOX-RoPE one."""
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    g = np.random.default_rng(3)
    ours = [g.standard_normal((H, D)).astype(np.float32) for _ in range(L)]
    theirs = {il: llama_cpp_permute(t.reshape(H * D, 1), H).reshape(-1) for il, t in enumerate(ours)}
    path = tmp_path / "fork.gguf"
    path.write_bytes(fork_file(theirs))
    for got, want in zip(load(path, model_type="llama"), ours, strict=True):
        assert np.array_equal(got.numpy(), want)
    # transformers' GGUF loader undoes the same permutation on k_proj rows: a third opinion.
    back = LlamaTensorProcessor._reverse_permute_weights(None, theirs[0].reshape(H * D, 1), H, H)
    assert np.array_equal(back.reshape(H, D), ours[0])
    # qwen2 (NEOX RoPE): llama.cpp's order is transformers'; the file is used as written.
    for got, want in zip(load(path, model_type="qwen2"), theirs.values(), strict=True):
        assert np.array_equal(got.numpy().reshape(-1), want)
    # Without an architecture there is no way to tell: refused, never read in the wrong order.
    with pytest.raises(ValueError, match="llama.cpp's order .*model_type"):
        load(path, model_type=None)
    # A file naming its architecture (general.architecture) is converted by it...
    path.write_bytes(fork_file(theirs, extra_kvs=[kv_str("general.architecture", "llama")]))
    assert np.array_equal(load(path, model_type=None)[0].numpy(), ours[0])
    # ... and one from another family is "another model".
    path.write_bytes(fork_file(theirs, extra_kvs=[kv_str("general.architecture", "qwen2")]))
    with pytest.raises(ValueError, match="GGUF 'qwen2' model .*--kv-mean-center-any-model"):
        load(path, model_type="llama")
    with pytest.warns(UserWarning, match="using it anyway"):
        load(path, model_type="llama", allow_other_model=True)


def test_kvslim_llama_cpp_order_file_round_trips(tmp_path):
    from kvslim.calibration.channelorder import to_llama_cpp_order

    b = bias_set()
    write_bias_file(tmp_path / "ll.gguf", to_llama_cpp_order(b, "llama"))
    assert all(torch.equal(x, y) for x, y in zip(load(tmp_path / "ll.gguf"), b.tensors, strict=True))


def valid_file_bytes(tmp_path) -> bytes:
    write_bias_file(tmp_path / "valid.gguf", bias_set())
    return (tmp_path / "valid.gguf").read_bytes()


def assert_refused_cleanly(path) -> None:
    """read_layers and load_mean_center either refuse with a one-line ValueError naming the file or
    give finite (H, D) tensors; nothing else (no other exception type, no hang)."""
    for reader in (read_layers, load):
        try:
            out = reader(path)
        except ValueError as e:
            assert "\n" not in str(e) and str(path) in str(e), str(e)
            continue
        if reader is load:
            assert all(t.shape == (H, D) and bool(torch.isfinite(t).all()) for t in out)


def test_fuzz_truncations(tmp_path):
    data = valid_file_bytes(tmp_path)
    path = tmp_path / "cut.gguf"
    header_end = data.index(b"kv_bar.blk.1.k") + 64
    offsets = sorted({*range(0, header_end), *range(header_end, len(data), 7)})
    for n in offsets:
        path.write_bytes(data[:n])
        with pytest.raises(ValueError) as e:
            read_layers(path)
        assert "\n" not in str(e.value) and str(path) in str(e.value), (n, str(e.value))
    path.write_bytes(data)
    assert sorted(read_layers(path)[0]) == [0, 1]


def test_fuzz_random_bytes_and_mutations(tmp_path):
    rng = np.random.default_rng(0)
    data = valid_file_bytes(tmp_path)
    path = tmp_path / "fuzz.gguf"
    start = time.perf_counter()
    for i in range(300):
        if i < 100:
            blob = rng.integers(0, 256, rng.integers(0, 600)).astype(np.uint8).tobytes()
            if i % 2:
                blob = b"GGUF" + struct.pack("<I", 3) + blob  # past the magic, into the counts
        else:
            arr = bytearray(data)
            for _ in range(rng.integers(1, 6)):  # flip bytes, mostly in the header
                arr[int(rng.integers(0, min(len(arr), 700)))] = int(rng.integers(0, 256))
            blob = bytes(arr)
        path.write_bytes(blob)
        assert_refused_cleanly(path)
    assert time.perf_counter() - start < 60


def test_forged_lengths_do_not_hang(tmp_path):
    """gguf-py would loop over a forged array length; the structure walk refuses it first."""
    path = tmp_path / "forged.gguf"
    huge_array = ("x", 9, struct.pack("<IQ", 0, 2**62))  # an array of 2^62 uint8
    huge_strings = ("y", 9, struct.pack("<IQ", 8, 2**40))  # an array of 2^40 strings
    huge_string = ("z", 8, struct.pack("<Q", 2**63))
    for kv in (huge_array, huge_strings, huge_string):
        path.write_bytes(gguf_bytes([kv_str("general.type", "kv-mean-center"), kv], []))
        start = time.perf_counter()
        with pytest.raises(ValueError, match="not a readable GGUF file"):
            read_layers(path)
        assert time.perf_counter() - start < 1
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 2**60, 2**60))
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        read_layers(path)


GOOD = {il: np.zeros(H * D, np.float32) for il in range(L)}


def malformed_cases() -> dict[str, tuple[bytes, str]]:
    """name -> (file bytes, the message it must be refused with)."""
    t = GOOD
    base = [kv_u32("kv_mean_center.schema_version", 1), kv_bool("kv_mean_center.k_rot", False)]

    def with_kvs(*kvs, tensors=None):
        tens = (
            tensors if tensors is not None else [f32_tensor(f"kv_bar.blk.{il}.k", v) for il, v in t.items()]
        )
        return gguf_bytes(list(kvs), tens)

    typ = kv_str("general.type", "kv-mean-center")
    ok_tensors = [f32_tensor(f"kv_bar.blk.{il}.k", v) for il, v in t.items()]
    return {
        "general.type is a number": (
            with_kvs(kv_u32("general.type", 1), *base),
            "general.type has type UINT32",
        ),
        "general.type is another file's": (
            with_kvs(kv_str("general.type", "imatrix"), *base),
            "not a K mean-centering",
        ),
        "schema_version is a string": (
            with_kvs(typ, kv_str("kv_mean_center.schema_version", "1")),
            "schema_version has type STRING",
        ),
        "schema_version 3": (
            with_kvs(typ, kv_u32("kv_mean_center.schema_version", 3)),
            "schema_version is 3",
        ),
        "k_rot is a number": (with_kvs(typ, kv_u32("kv_mean_center.k_rot", 1)), "k_rot has type UINT32"),
        "channel_order unknown": (
            with_kvs(typ, *base, kv_str("kv_mean_center.channel_order", "gpt-neox")),
            "channel_order is 'gpt-neox'",
        ),
        "channel_order is a number": (
            with_kvs(typ, *base, kv_u32("kv_mean_center.channel_order", 0)),
            "channel_order has type UINT32",
        ),
        "n_tokens negative": (with_kvs(typ, *base, kv_i64("kv_mean_center.n_tokens", -5)), "n_tokens is -5"),
        "ctx is a string": (with_kvs(typ, *base, kv_str("kv_mean_center.ctx", "512")), "ctx has type STRING"),
        "text_sha256 not hex": (
            with_kvs(typ, *base, kv_str("kv_mean_center.text_sha256", "xyz")),
            "text_sha256 is not 64",
        ),
        "kvslim fingerprint not hex": (
            with_kvs(
                typ,
                *base,
                kv_str("kv_mean_center.model_sha256", "nothex"),
                kv_str("kv_mean_center.model_sha256_kind", "kvslim"),
            ),
            "model_sha256 is not kvslim's",
        ),
        "duplicate key": (with_kvs(typ, typ, *base), "not a readable GGUF file"),
        "no tensors": (with_kvs(typ, *base, tensors=[]), "no kv_bar.blk"),
        "F16 tensor": (
            with_kvs(
                typ, *base, tensors=[("kv_bar.blk.0.k", [H * D], 1, np.zeros(H * D, np.float16).tobytes())]
            ),
            "has type F16, expected F32",
        ),
        "3-D tensor": (
            with_kvs(
                typ, *base, tensors=[("kv_bar.blk.0.k", [D, H, 1], 0, np.zeros(H * D, np.float32).tobytes())]
            ),
            "3 dimensions",
        ),
        "alias name kv_bar.blk.01.k": (
            with_kvs(typ, *base, tensors=[*ok_tensors, f32_tensor("kv_bar.blk.01.k", np.ones(H * D))]),
            "'kv_bar.blk.01.k' is not canonical",
        ),
        "alias only kv_bar.blk.01.k": (
            with_kvs(typ, *base, tensors=[ok_tensors[0], f32_tensor("kv_bar.blk.01.k", np.ones(H * D))]),
            "is not canonical",
        ),
        "duplicate tensor": (
            with_kvs(typ, *base, tensors=[*ok_tensors, ok_tensors[1]]),
            "duplicated tensor|appears twice",
        ),
        "unexpected tensor": (
            with_kvs(typ, *base, tensors=[*ok_tensors, f32_tensor("token_embd.weight", np.ones(4))]),
            "unexpected tensor 'token_embd.weight'",
        ),
        "tensor data past the end": (with_kvs(typ, *base)[:-40], "not a readable GGUF file"),
        "tensor name not UTF-8": (
            with_kvs(
                typ,
                *base,
                tensors=[(b"kv_bar.blk.\xff.k", [H * D], 0, np.zeros(H * D, np.float32).tobytes())],
            ),
            "not a readable GGUF file",
        ),
        "big-endian / unknown version": (b"GGUF" + struct.pack("<I", 3 << 24) + b"\0" * 40, "version"),
    }


@pytest.mark.parametrize("case", list(malformed_cases()))
def test_malformed_field(tmp_path, case):
    data, message = malformed_cases()[case]
    path = tmp_path / "bad.gguf"
    path.write_bytes(data)
    with pytest.raises(ValueError, match=message) as e:
        read_bias_file(path)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("values", "kw", "message"),
    [
        (np.full(H * D, np.nan), {}, "1 non-finite|64 non-finite"),
        (np.full(H * D, np.inf), {}, "non-finite"),
        (np.full(H * D, 1e7), {"k_format": "q4_0"}, r"magnitude 1e\+07, but q4_0 blocks hold at most 524032"),
        (np.full(H * D, 1e7), {"k_format": "q8_0"}, "q8_0 blocks hold at most"),
        (np.full(H * D, 1e9), {}, "mean-centering formats' blocks"),
        (
            np.full(H * D, 7e4),
            {"k_format": "q8_0", "key_dtype": torch.float16},
            "float16 keys hold at most 65504",
        ),
    ],
)
def test_impossible_bias_values_refused_at_load(tmp_path, values, kw, message):
    path = tmp_path / "b.gguf"
    path.write_bytes(fork_file({0: np.zeros(H * D), 1: values}))
    with pytest.raises(ValueError, match=rf"kv_bar\.blk\.1\.k .*{message}"):
        load(path, **kw)


def test_large_but_possible_bias_loads(tmp_path):
    path = tmp_path / "b.gguf"
    path.write_bytes(fork_file({0: np.zeros(H * D), 1: np.full(H * D, 5e5)}))
    assert float(load(path, k_format="q4_0")[1].max()) == 5e5
    with pytest.raises(ValueError, match="float16 keys"):
        load(path, k_format="q4_0", key_dtype=torch.float16)


def test_fingerprint_checked_and_overridable(tmp_path):
    path = tmp_path / "b.gguf"
    write_bias_file(path, bias_set(fingerprint="sha256:" + "ab" * 32))
    other = "sha256:" + "cd" * 32
    with pytest.raises(ValueError) as e:
        load(path, model_fingerprint=other)
    msg = str(e.value)
    assert "sha256:abababababababab" in msg and "sha256:cdcdcdcdcdcdcdcd" in msg
    assert "allow_other_model=True" in msg and "--kv-mean-center-any-model" in msg
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        load(path, model_fingerprint=other, allow_other_model=True)
    assert len(w) == 1 and "using it anyway" in str(w[0].message)


def test_slimcache_refuses_a_bias_from_another_model(tmp_path):
    from kvslim import SlimCache
    from kvslim.calibration.calibrate import collect_k_means_from_ids
    from kvslim.models import model_fingerprint

    base, instruct = tiny_model("llama", seed=0), tiny_model("llama", seed=1)  # same shapes
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # few tokens
        bias = collect_k_means_from_ids(base, torch.arange(3, 67), ctx=64, progress=False)
    path = tmp_path / "base.gguf"
    write_bias_file(path, bias)
    fp = model_fingerprint(instruct)
    SlimCache(
        kv_quantize="q4_0", mean_center=path, config=base.config, model_fingerprint=model_fingerprint(base)
    )
    with pytest.raises(ValueError, match="calibrated for another model"):
        SlimCache(kv_quantize="q4_0", mean_center=path, config=instruct.config, model_fingerprint=fp)
    with pytest.warns(UserWarning, match="calibrated for another model"):
        SlimCache(
            kv_quantize="q4_0",
            mean_center=path,
            config=instruct.config,
            model_fingerprint=fp,
            allow_other_model=True,
        )


def test_calibrate_warns_about_too_few_tokens():
    from kvslim.calibration.calibrate import MIN_USEFUL_TOKENS, collect_k_means_from_ids

    model = tiny_model("llama")
    with pytest.warns(UserWarning, match=rf"calibrating on 5 tokens.*at least {MIN_USEFUL_TOKENS} tokens"):
        collect_k_means_from_ids(model, torch.arange(3, 8), ctx=64, progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        collect_k_means_from_ids(model, torch.arange(MIN_USEFUL_TOKENS) % 120 + 3, ctx=256, progress=False)


# ---------------------------------------------------------------------------------------------
# 4 and 6. the CLI: one line for every error, checks before the model loads

PROMPT = "t5 t6 t7 t8"


@pytest.fixture
def no_model_load(monkeypatch):
    """Fail the test if a model is loaded (the error must come before)."""
    from kvslim import models

    def refuse(*a, **k):
        raise AssertionError("the model was loaded before the error")

    monkeypatch.setattr(models, "load_model", refuse)


@pytest.fixture
def long_text(tmp_path) -> Path:
    path = tmp_path / "text.txt"
    path.write_text(" ".join(f"t{3 + i % 120}" for i in range(600)))
    return path


def _broken_model_dirs(model_dir: str, tmp_path: Path) -> dict[str, Path]:
    bad_config = tmp_path / "bad-config"
    shutil.copytree(model_dir, bad_config)
    (bad_config / "config.json").write_text("{not json")
    no_weights = tmp_path / "no-weights"
    shutil.copytree(model_dir, no_weights, ignore=shutil.ignore_patterns("*.safetensors"))
    no_config = tmp_path / "no-config"
    shutil.copytree(model_dir, no_config, ignore=shutil.ignore_patterns("config.json"))
    from kvslim.models import embedded_gguf_path

    truncated = tmp_path / "truncated.gguf"
    with open(embedded_gguf_path(), "rb") as f:
        truncated.write_bytes(f.read(4096))
    return {
        "bad-config": bad_config,
        "no-weights": no_weights,
        "no-config": no_config,
        "truncated": truncated,
    }


CLI_MODEL_CASES = {
    "bad-config": "cannot load the model in .*bad-config",
    "no-weights": "cannot load the model in .*no-weights",
    "no-config": "cannot load the model in .*no-config",
    "truncated": "cannot load GGUF file .*truncated.gguf",
}


@pytest.mark.parametrize("case", list(CLI_MODEL_CASES))
def test_cli_broken_model_is_one_line(capsys, model_dir, tmp_path, case):
    path = _broken_model_dirs(model_dir, tmp_path)[case]
    code, out, err = run_cli(capsys, "sample", "--model", path, "--prompt", PROMPT, "--tokens", "2")
    assert code == 2
    assert __import__("re").search(CLI_MODEL_CASES[case], one_error_line(err)), err


@pytest.mark.parametrize("device", ["mps", "xpu", "meta", "cuda:7", "tpu"])
def test_cli_unavailable_device(capsys, no_model_load, device):
    if device.startswith("cuda") and torch.cuda.device_count() > 7:
        pytest.skip("this machine has a cuda:7")
    for command in (
        ["sample", "--prompt", PROMPT],
        ["calibrate", "--text", __file__, "--out", "/tmp/x.gguf"],
    ):
        code, out, err = run_cli(capsys, *command, "--device", device)
        assert code == 2 and f"--device {device}" in one_error_line(err), err


def test_cli_non_utf8_prompt_on_stdin(capsys, monkeypatch, no_model_load):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"caf\xe9 au lait\n"), encoding="utf-8"))
    code, out, err = run_cli(capsys, "sample")
    assert (
        code == 2
        and "the prompt on stdin is not UTF-8 text (invalid continuation byte at byte 3)"
        in one_error_line(err)
    )


def test_cli_non_utf8_prompt_argument(capsys, no_model_load):
    # `kvslim sample --prompt $'caf\xe9'`: Python hands the byte over as a lone surrogate.
    prompt = b"caf\xe9".decode("utf-8", "surrogateescape")
    code, out, err = run_cli(capsys, "sample", "--prompt", prompt)
    assert code == 2 and "--prompt is not UTF-8 text (byte 0xe9 at character 3)" in one_error_line(err)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["sample", "--prompt", PROMPT, "--seed", "1e23"],
            "argument --seed: must be an integer in [0, 18446744073709551615], got '1e23'",
        ),
        (["sample", "--prompt", PROMPT, "--seed", str(10**23)], "argument --seed: must be an integer"),
        (["sample", "--prompt", PROMPT, "--seed", "-1"], "argument --seed: must be an integer"),
        (["eval", "passkey", "--seed", str(2**64)], "argument --seed: must be an integer"),
        (["bench", "--seed", "1.5"], "argument --seed: must be an integer"),
        (
            ["eval", "ppl", "--text", __file__, "--tokens", "1"],
            "--tokens must be >= 2, got 1: perplexity scores",
        ),
    ],
)
def test_cli_bad_numbers_name_the_flag(capsys, no_model_load, argv, message):
    code, out, err = run_cli(capsys, *argv)
    assert code == 2 and message in one_error_line(err), err


def test_cli_output_paths_checked_before_the_model_loads(capsys, no_model_load, tmp_path, long_text):
    d = str(tmp_path)  # a directory where a file is expected
    cases = [
        ["calibrate", "--text", long_text, "--out", d],
        ["sample", "--prompt", PROMPT, "--report-json", d],
        ["sample", "--prompt", PROMPT, "--rss-log", d],
        ["eval", "ppl", "--text", long_text, "--json", d],
        ["eval", "ppl", "--text", long_text, "--plot", d],
        ["eval", "greedy", "--json", d],
        ["eval", "memory", "--json", d],
        ["eval", "passkey", "--json", d],
        ["bench", "--json", d],
    ]
    for argv in cases:
        code, out, err = run_cli(capsys, *argv)
        assert code == 2 and f"{d}: is a directory, expected a file path" in one_error_line(err), (argv, err)


def test_cli_bias_file_checked_before_the_model_loads(capsys, no_model_load, tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 10)
    for argv in (
        ["sample", "--prompt", PROMPT, "--kv-quantize", "q4_0", "--kv-mean-center", bad],
        ["eval", "greedy", "--config", f"q4_0,mean_center={bad}"],
        ["bench", "--config", f"q4_0,mean_center={bad}"],
    ):
        code, out, err = run_cli(capsys, *argv)
        assert code == 2 and "not a readable GGUF file" in one_error_line(err), (argv, err)


def test_cli_json_nan_is_null_with_a_note(tmp_path, capsys):
    from kvslim.cli.common import write_json as cli_write_json

    path = tmp_path / "r.json"
    cli_write_json(str(path), {"results": [{"ppl": 3.0, "ratio": float("nan")}, {"x": float("inf")}]})
    data = json.loads(path.read_text(), parse_constant=lambda c: pytest.fail(f"bare {c} in JSON"))
    assert data == {"results": [{"ppl": 3.0, "ratio": None}, {"x": None}]}
    err = capsys.readouterr().err
    assert "2 value(s) are not numbers" in err and "results[0].ratio, results[1].x" in err


def test_cli_huge_group_says_nothing_is_quantized(capsys, model_dir):
    code, out, err = run_cli(
        capsys, "sample", "--model", model_dir, "--prompt", PROMPT, "--tokens", "3", "--temperature", "0",
        "--kv-quantize", "int4", "--kv-group-size", "1000000000", "--kv-residual", "0",
    )  # fmt: skip
    assert code == 0, err
    lines = err.splitlines()
    assert "int4" in lines[0] and "(nothing quantized in this run)" in lines[0]
    assert any(line.startswith("kvslim: warning: nothing will be quantized") for line in lines)
    assert "quantizing starts at 1000000000 stored tokens" in err


def test_cli_calibrate_few_tokens_warns(capsys, model_dir, tmp_path):
    text = tmp_path / "five.txt"
    text.write_text("t5 t6 t7 t8 t9")
    code, out, err = run_cli(
        capsys, "calibrate", "--model", model_dir, "--text", text, "--out", tmp_path / "b.gguf"
    )
    assert code == 0, err
    warning = [line for line in err.splitlines() if line.startswith("kvslim: warning:")]
    assert (
        len(warning) == 1 and "calibrating on 5 tokens" in warning[0] and "at least 512 tokens" in warning[0]
    )


def test_cli_calibrate_on_a_full_disk_keeps_the_old_file(capsys, model_dir, long_text, tiny_disk):
    out = tiny_disk / "bias.gguf"
    code, _, err = run_cli(capsys, "calibrate", "--model", model_dir, "--text", long_text, "--out", out)
    assert code == 0, err
    good = sha256(out)
    fill(tiny_disk)
    code, printed, err = run_cli(
        capsys, "calibrate", "--model", model_dir, "--text", long_text, "--out", out, "--max-tokens", "512"
    )
    assert code == 2 and "wrote" not in printed
    line = one_error_line(err)
    assert "cannot write bias file" in line and "the existing file is unchanged" in line
    assert "No space left on device" in line or "short write" in line
    assert sha256(out) == good and no_temporaries(tiny_disk)


def test_cli_calibrate_write_failing_midway(capsys, model_dir, long_text, tmp_path, monkeypatch):
    """Without a tmpfs: the write dies half way (ENOSPC)."""
    from gguf import GGUFWriter

    out = tmp_path / "bias.gguf"
    out.write_bytes(b"previous contents")

    def half_then_enospc(self, *a, **k):
        for fout in self.fout:
            fout.write(b"\x01" * 100)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(GGUFWriter, "write_tensors_to_file", half_then_enospc)
    code, printed, err = run_cli(capsys, "calibrate", "--model", model_dir, "--text", long_text, "--out", out)
    assert code == 2 and "wrote" not in printed and "No space left on device" in one_error_line(err)
    assert out.read_bytes() == b"previous contents" and no_temporaries(tmp_path)


def test_cli_report_json_on_a_full_disk(capsys, model_dir, tiny_disk):
    report = tiny_disk / "report.json"
    args = ["sample", "--model", model_dir, "--prompt", PROMPT, "--tokens", "2", "--report-json", report]
    assert run_cli(capsys, *args)[0] == 0
    good = report.read_bytes()
    fill(tiny_disk)
    code, out, err = run_cli(capsys, *args)
    errors = [line for line in err.splitlines() if line.startswith("kvslim: error:")]
    assert code == 2 and "Traceback" not in err
    assert len(errors) == 1 and "cannot write --report-json" in errors[0] and "No space left" in errors[0]
    assert report.read_bytes() == good and no_temporaries(tiny_disk)


def test_cli_read_only_cache_dir(capsys, monkeypatch, tmp_path):
    """The embedded model with a read-only cache directory and no converted copy yet."""
    with tmpfs(tmp_path / "ro", "size=64k,ro") as ro:
        monkeypatch.setenv("KVSLIM_CACHE_DIR", str(ro))
        code, out, err = run_cli(capsys, "sample", "--prompt", PROMPT, "--tokens", "1")
    line = one_error_line(err)
    assert code == 2 and "cannot save the converted copy" in line and "Read-only file system" in line
    assert "KVSLIM_CACHE_DIR" in line


def test_read_only_cache_dir_without_a_mount(monkeypatch, tmp_path):
    from kvslim import models

    def erofs(self, *a, **k):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))

    monkeypatch.setenv("KVSLIM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(Path, "mkdir", erofs)
    with pytest.raises(ValueError, match="cannot save the converted copy .*Read-only file system"):
        models.check_cache_writable()


def test_cli_bias_from_another_model(capsys, model_dir, tmp_path, long_text):
    """Base vs instruct of one family: same shapes, other weights."""
    other = tmp_path / "other-model"
    shutil.copytree(model_dir, other)
    tiny_model("llama", seed=1).save_pretrained(other)
    bias = tmp_path / "other.gguf"
    assert run_cli(capsys, "calibrate", "--model", other, "--text", long_text, "--out", bias)[0] == 0
    args = ["sample", "--model", model_dir, "--prompt", PROMPT, "--tokens", "2", "--kv-quantize", "q4_0"]
    code, out, err = run_cli(capsys, *args, "--kv-mean-center", bias)
    line = one_error_line(err)
    assert code == 2 and "calibrated for another model" in line and "--kv-mean-center-any-model" in line
    code, out, err = run_cli(capsys, *args, "--kv-mean-center", bias, "--kv-mean-center-any-model")
    assert code == 0, err
    warnings_ = [line for line in err.splitlines() if "calibrated for another model" in line]
    assert (
        len(warnings_) == 1
        and warnings_[0].startswith("kvslim: warning:")
        and "using it anyway" in warnings_[0]
    )
    # eval hands the fingerprint over too
    code, out, err = run_cli(
        capsys,
        "eval",
        "greedy",
        "--model",
        model_dir,
        "--tokens",
        "2",
        "--config",
        f"q4_0,mean_center={bias}",
    )
    assert code == 2 and "calibrated for another model" in one_error_line(err)


# ---------------------------------------------------------------------------------------------
# 5. the converted model copy


@pytest.fixture
def embedded(monkeypatch, tmp_path, model_dir):
    """The embedded model stood in for by the tiny one: a fake .gguf whose "conversion" loads
    model_dir; returns (gguf path, list of conversions made)."""
    from kvslim.models import converted, sources

    gguf = tmp_path / "fake.gguf"
    gguf.write_bytes(b"GGUF stand-in")
    monkeypatch.setattr(sources, "embedded_gguf_path", lambda: gguf)  # what resolve_spec(None) names
    monkeypatch.setenv("KVSLIM_CACHE_DIR", str(tmp_path / "cache"))
    conversions = []

    def from_gguf(path, **kwargs):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        conversions.append(path)
        return AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32
        ), AutoTokenizer.from_pretrained(model_dir)

    monkeypatch.setattr(converted, "_from_gguf", from_gguf)  # what the conversion unpacks
    return gguf, conversions


def _load_embedded(**kw):
    from kvslim.models import load_model

    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        model, _ = load_model(None, **kw)
    return model, [str(x.message) for x in w]


def test_converted_copy_records_sizes_hashes_and_fingerprint(embedded):
    from kvslim.models import converted_dir, model_fingerprint

    gguf, conversions = embedded
    model, warned = _load_embedded()
    final = converted_dir(gguf)
    marker = json.loads((final / "kvslim-source.json").read_text())
    assert marker["fingerprint"] == model_fingerprint(model) and not warned
    assert set(marker["files"]) >= {"config.json", "model.safetensors", "tokenizer.json"}
    weights = marker["files"]["model.safetensors"]
    assert weights["size"] == (final / "model.safetensors").stat().st_size
    assert weights["sha256"] == sha256(final / "model.safetensors")
    _load_embedded()
    assert len(conversions) == 1  # the good copy is reused


def _damage(final: Path, how: str) -> None:
    weights = final / "model.safetensors"
    if how == "truncated":
        with open(weights, "r+b") as f:
            f.truncate(weights.stat().st_size // 2)
    elif how == "config deleted":
        (final / "config.json").unlink()
    elif how == "overwritten in place":  # same size, the tensor bytes replaced
        size = weights.stat().st_size
        header = 8 + struct.unpack("<Q", weights.read_bytes()[:8])[0]
        with open(weights, "r+b") as f:
            f.seek(header)
            f.write(b"\x7f" * (size - header))
    elif how == "marker unreadable":
        (final / "kvslim-source.json").write_text("{")


@pytest.mark.parametrize(
    ("how", "problem"),
    [
        ("truncated", r"model\.safetensors has \d+ bytes, \d+ were written"),
        ("config deleted", "config.json is missing"),
        (
            "overwritten in place",
            r"model\.safetensors's content changed since it was written \(sha256 differs\)",
        ),
    ],
)
def test_damaged_copy_is_converted_again(embedded, how, problem):
    from kvslim.models import converted_dir, model_fingerprint

    gguf, conversions = embedded
    good, _ = _load_embedded()
    _damage(converted_dir(gguf), how)
    model, warned = _load_embedded()
    assert len(conversions) == 2 and len(warned) == 1
    assert __import__("re").search(
        f"the converted model copy .* is damaged \\({problem}\\); converting it again", warned[0]
    )
    assert model_fingerprint(model) == model_fingerprint(good)
    assert _load_embedded()[1] == [] and len(conversions) == 2  # repaired for good


def test_verify_finds_a_change_sizes_cannot(embedded):
    from kvslim.models import converted_dir

    gguf, conversions = embedded
    _load_embedded()
    weights = converted_dir(gguf) / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-3] ^= 0x01  # one bit of the last value: same size; the sampled fingerprint may not see it
    weights.write_bytes(bytes(data))
    model, warned = _load_embedded(verify=True)
    assert len(conversions) == 2 and "sha256 differs" in warned[0]


def test_damaged_copy_that_cannot_be_replaced_says_what_to_delete(embedded, monkeypatch):
    from kvslim import models
    from kvslim.models import converted

    gguf, conversions = embedded
    _load_embedded()
    final = models.converted_dir(gguf)
    _damage(final, "config deleted")

    def erofs(path, *a, **k):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))

    monkeypatch.setattr(converted.shutil, "rmtree", erofs)
    with pytest.raises(ValueError, match=f"cannot replace the damaged copy .*delete {final} and run again"):
        _load_embedded()


def test_old_marker_is_upgraded(embedded):
    from kvslim.models import converted_dir

    gguf, conversions = embedded
    _load_embedded()
    marker_path = converted_dir(gguf) / "kvslim-source.json"
    marker = json.loads(marker_path.read_text())
    old = {k: marker[k] for k in ("source", "size", "mtime_ns", "version")}  # what kvslim 0.1 wrote
    marker_path.write_text(json.dumps(old))
    _load_embedded()
    assert "files" in json.loads(marker_path.read_text()) and len(conversions) == 1


def test_cli_damaged_copy(capsys, embedded):
    from kvslim.models import converted_dir

    gguf, conversions = embedded
    args = ["sample", "--prompt", PROMPT, "--tokens", "2", "--temperature", "0"]
    assert run_cli(capsys, *args)[0] == 0
    _damage(converted_dir(gguf), "truncated")
    code, out, err = run_cli(capsys, *args)
    assert code == 0 and "Traceback" not in err
    damaged = [line for line in err.splitlines() if "damaged" in line]
    assert len(damaged) == 1 and damaged[0].startswith("kvslim: warning: the converted model copy")
    _damage(converted_dir(gguf), "overwritten in place")
    code, out, err = run_cli(capsys, *args, "--verify")
    assert code == 0 and "sha256 differs" in err and len(conversions) == 3


# ---------------------------------------------------------------------------------------------
# 7. the kernel build directory


@pytest.fixture
def trivial_kernels(monkeypatch, tmp_path):
    """A one-line C source in place of the kernels (the build machinery is what is tested)."""
    from kvslim.kernels import clib as cpu  # the build/trust/lock half of the C kernels

    if cpu.find_compiler() is None:
        pytest.skip("no C compiler")
    src = tmp_path / "src"
    src.mkdir()
    (src / "k.c").write_text("int kv_abi_version(void) { return 1; }\n")
    monkeypatch.setattr(cpu, "SOURCES", src)
    return cpu


def _build_warns(cpu, match: str) -> Path:
    with pytest.warns(RuntimeWarning, match=match) as record:
        path, _ = cpu.build()
    assert len(record) == 1 and "\n" not in str(record[0].message)
    assert path.parent.name.startswith(cpu.PRIVATE_PREFIX) and path.is_file()
    assert (path.parent.stat().st_mode & 0o777) == 0o700
    return path


def test_kernels_read_only_cache_dir(trivial_kernels, monkeypatch, tmp_path):
    cpu = trivial_kernels
    with tmpfs(tmp_path / "ro", "size=64k") as ro:
        (ro / "kernels").mkdir(mode=0o700)  # an existing cache, then the file system goes read-only
        subprocess.run(["mount", "-o", "remount,ro", str(ro)], check=True)
        monkeypatch.setenv("KVSLIM_CACHE_DIR", str(ro))
        path = _build_warns(
            cpu, r"kernel cache .* is not writable .*private temporary directory.*second or two"
        )
        shutil.rmtree(path.parent)
        monkeypatch.setenv("KVSLIM_CACHE_DIR", str(ro / "new"))
        path = _build_warns(cpu, r"cannot be created \(Read-only file system\)")
    shutil.rmtree(path.parent)


def test_kernels_cache_dir_cannot_be_created(trivial_kernels, monkeypatch, tmp_path):
    cpu = trivial_kernels
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("KVSLIM_CACHE_DIR", str(tmp_path / "file" / "cache"))
    path = _build_warns(cpu, "cannot be created")
    shutil.rmtree(path.parent)


def test_kernels_foreign_owned_cache_dir(trivial_kernels, monkeypatch, tmp_path):
    cpu = trivial_kernels
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        pytest.skip("giving a directory to another user needs root")
    monkeypatch.setenv("KVSLIM_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "cache" / "kernels").mkdir(parents=True)
    os.chown(tmp_path / "cache" / "kernels", 65534, 65534)
    path = _build_warns(cpu, r"is owned by another user \(uid 65534\)")
    shutil.rmtree(path.parent)


def test_kernels_dir_writable_by_others_is_tightened_and_bad_library_rebuilt(
    trivial_kernels, monkeypatch, tmp_path
):
    cpu = trivial_kernels
    monkeypatch.setenv("KVSLIM_CACHE_DIR", str(tmp_path / "cache"))
    shared = tmp_path / "cache" / "kernels"
    shared.mkdir(parents=True)
    os.chmod(shared, 0o777)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        path, _ = cpu.build()
    assert path.parent == shared and (shared.stat().st_mode & 0o777) == 0o755
    assert (path.stat().st_mode & 0o022) == 0
    os.chmod(path, 0o666)  # someone else could have replaced it: never loaded, rebuilt
    inode = path.stat().st_ino
    assert cpu.build()[0] == path and path.stat().st_ino != inode and (path.stat().st_mode & 0o022) == 0


def test_kernels_stale_temporaries_removed(trivial_kernels, monkeypatch, tmp_path):
    cpu = trivial_kernels
    monkeypatch.setenv("KVSLIM_CACHE_DIR", str(tmp_path / "cache"))
    shared = tmp_path / "cache" / "kernels"
    shared.mkdir(parents=True, mode=0o700)
    old, fresh = shared / ".abc.killed.so", shared / ".abc.building.so"
    old.write_text("x")
    fresh.write_text("x")
    os.utime(old, (time.time() - 7200, time.time() - 7200))
    cpu.build()
    assert not old.exists() and fresh.exists()


def test_kernels_concurrent_first_uses_compile_once(trivial_kernels, monkeypatch, tmp_path):
    cpu = trivial_kernels
    real = cpu.find_compiler()
    counter = tmp_path / "compiles"
    wrapper = tmp_path / "cc"
    wrapper.write_text(
        f'#!/bin/sh\ncase " $* " in *" -o "*) echo x >> {counter}; sleep 0.3;; esac\nexec {" ".join(real)} "$@"\n'
    )
    wrapper.chmod(0o755)
    monkeypatch.setenv("CC", str(wrapper))
    monkeypatch.setenv("KVSLIM_CACHE_DIR", str(tmp_path / "cache"))
    results = []
    threads = [threading.Thread(target=lambda: results.append(cpu.build())) for _ in range(3)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert len(results) == 3 and len({r[0] for r in results}) == 1
    assert counter.read_text().count("x") == 1


def test_kernels_private_dir_removed_once_loaded(trivial_kernels, monkeypatch, tmp_path):
    cpu = trivial_kernels
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("KVSLIM_CACHE_DIR", str(tmp_path / "file" / "cache"))
    built = []
    real_build = cpu.build
    monkeypatch.setattr(cpu, "build", lambda *a, **k: built.append(real_build(*a, **k)) or built[-1])
    with (
        pytest.warns(RuntimeWarning, match="private temporary directory"),
        pytest.raises(AttributeError, match="kv_has_openmp"),
    ):
        cpu._load()  # the one-line stand-in lacks the kernels' symbols: loaded, then refused
    assert not built[0][0].parent.exists()


# ---------------------------------------------------------------------------------------------
# in a subprocess: signals, closed pipes, a fresh interpreter


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env["PYTHONPATH"] = SRC + os.pathsep + env.get("PYTHONPATH", "")
    return env


def test_help_imports_neither_torch_nor_transformers():
    res = subprocess.run(
        [PYTHON, "-X", "importtime", "-c", "from kvslim.cli import main; main(['--help'])"],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=60,
    )
    imported = {line.split("|")[-1].strip().split(".")[0] for line in res.stderr.splitlines() if "|" in line}
    assert res.returncode == 0 and "usage: kvslim" in res.stdout
    assert not imported & {"torch", "transformers", "numpy"}, imported & {"torch", "transformers", "numpy"}


def test_models_after_a_plain_import():
    """README: `import kvslim` then `kvslim.models.load_model(None)` (kvslim.models loads lazily)."""
    res = subprocess.run(
        [PYTHON, "-c", "import kvslim; print(callable(kvslim.models.load_model), kvslim.models.__name__)"],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=120,
    )
    assert res.returncode == 0 and res.stdout.split() == ["True", "kvslim.models"], res.stderr


def test_sigint_during_imports():
    script = (
        "import sys; from kvslim.cli import main; sys.stderr.write('ready\\n'); sys.stderr.flush(); "
        "sys.exit(main(['sample', '--prompt', 'x']))"
    )
    proc = subprocess.Popen([PYTHON, "-c", script], stderr=subprocess.PIPE, text=True, env=_env())
    assert proc.stderr.readline() == "ready\n"
    time.sleep(0.05)  # main() is importing the subcommand (torch, transformers: seconds)
    proc.send_signal(signal.SIGINT)
    err = proc.stderr.read()
    assert proc.wait(timeout=60) == 130
    assert one_error_line(err) == "kvslim: error: interrupted"


def test_sigterm_prints_the_report_and_exits_143(model_dir):
    argv = ["sample", "--model", model_dir, "--prompt", PROMPT, "--tokens", "3000", "--ignore-eos"]
    proc = subprocess.Popen(
        [PYTHON, "-c", f"import sys; from kvslim.cli import main; sys.exit(main({argv!r}))"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
    )
    banner = proc.stderr.readline()
    assert banner.startswith("kvslim sample | model"), banner
    time.sleep(0.3)
    proc.send_signal(signal.SIGTERM)
    err = proc.stderr.read()
    assert proc.wait(timeout=60) == 143
    assert "Traceback" not in err and "kvslim: interrupted | tokens seen" in err and "decode at" in err


def test_stderr_into_a_closed_pipe(model_dir):
    """`kvslim sample ... 2>&1 | head -c 10`: the reader leaves; kvslim stops quietly, exit 2."""
    argv = ["sample", "--model", model_dir, "--prompt", PROMPT, "--tokens", "3000", "--ignore-eos"]
    proc = subprocess.Popen(
        [PYTHON, "-c", f"import sys; from kvslim.cli import main; sys.exit(main({argv!r}))"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=_env(),
    )
    assert len(proc.stdout.read(10)) == 10
    proc.stdout.close()
    assert proc.wait(timeout=60) == 2


def test_cli_rss_log_and_plot_are_atomic(capsys, model_dir, long_text, tmp_path, monkeypatch):
    rss = tmp_path / "rss.csv"
    rss.write_text("old log\n")
    args = ["sample", "--model", model_dir, "--prompt", PROMPT, "--tokens", "3", "--rss-log", rss]
    assert run_cli(capsys, *args)[0] == 0
    rows = rss.read_text().splitlines()
    assert rows[0] == "step,rss_bytes" and len(rows) >= 2 and no_temporaries(tmp_path)

    pytest.importorskip("matplotlib")
    from kvslim import evaluate

    plot = tmp_path / "ppl.png"
    plot.write_bytes(b"old plot")

    def half_a_plot(report, path, **kw):
        Path(path).write_bytes(b"\x89PNG half")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(evaluate, "plot_ppl_curves", half_a_plot)
    code, out, err = run_cli(
        capsys, "eval", "ppl", "--model", model_dir, "--text", long_text, "--tokens", "24", "--prefill", "8",
        "--config", "int4", "--plot", plot, "--no-progress",
    )  # fmt: skip
    errors = [line for line in err.splitlines() if line.startswith("kvslim: error:")]
    assert code == 2 and "Traceback" not in err and len(errors) == 1
    assert "cannot write --plot" in errors[0] and "No space left" in errors[0]
    assert plot.read_bytes() == b"old plot" and no_temporaries(tmp_path)


def test_cli_impossible_bias_is_refused_before_generating(capsys, model_dir, tmp_path):
    path = tmp_path / "huge.gguf"
    write_bias_file(path, BiasSet(tensors=[torch.full((H, D), 1e7)] * L))
    code, out, err = run_cli(
        capsys, "sample", "--model", model_dir, "--prompt", PROMPT, "--tokens", "2", "--kv-quantize", "q4_0",
        "--kv-mean-center", path,
    )  # fmt: skip
    line = one_error_line(err)
    assert code == 2 and "kv_bar.blk.0.k" in line and "magnitude 1e+07" in line and out == ""


def test_fork_file_through_slimcache_and_the_cli(capsys, model_dir, tmp_path, tiny):
    """A fork-written file (llama.cpp's order, no channel_order key) for a llama model, end to end."""
    from kvslim import SlimCache

    model, _ = tiny
    g = np.random.default_rng(5)
    ours = [g.standard_normal((H, D)).astype(np.float32) for _ in range(L)]
    path = tmp_path / "fork.gguf"
    path.write_bytes(
        fork_file({il: llama_cpp_permute(t.reshape(H * D, 1), H).reshape(-1) for il, t in enumerate(ours)})
    )
    cache = SlimCache(kv_quantize="q4_0", mean_center=path, config=model.config)
    biases = [store.k_bias for store in cache.stores()]  # the biases the layers subtract
    for got, want in zip(biases, ours, strict=True):
        assert np.array_equal(got.numpy(), want)
    code, out, err = run_cli(
        capsys, "sample", "--model", model_dir, "--prompt", PROMPT, "--tokens", "2", "--kv-quantize", "q4_0",
        "--kv-mean-center", path,
    )  # fmt: skip
    assert code == 0 and "Traceback" not in err
