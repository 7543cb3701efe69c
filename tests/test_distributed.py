"""SlimCache under tensor parallelism and on a layer-split model, on the CPU.

Tensor parallel: a tiny random Llama (4 KV heads) saved to disk, loaded by 2 gloo processes with
transformers' ``tp_plan="auto"`` (tests/distributed_worker.py, started here as torchrun would start it), so
each rank's layers hand their cache 2 of the 4 KV heads. Every case — identity, int8, q8_0, StreamingLLM,
K mean-centering, the ``kvslim`` attention — is set against one process running the same weights whole:
the identity cache gives its logits (to float rounding: the row-wise all-reduce sums in another order),
every lossy one its greedy tokens, and the bytes of the ranks add up to the single process's.

Layer split: the same weights with a ``device_map`` putting layer 1 on disk (offloaded, run on the CPU) —
on a CPU-only machine the only two placements there are, so "each store on its layer's device" is the CPU
for both; what the test shows is that a split model runs the cache exactly as the whole one does.

The CLI under ``torchrun`` (``python -m torch.distributed.run --standalone --nproc-per-node 2 -m kvslim.cli``):
``kvslim sample`` prints the single process's text once, ``kvslim eval ppl`` its numbers, and a model that
cannot be split ends the run with one ``kvslim: error:`` line.

The in-process tests check the pieces without processes: the full-width bias that breaks a rank's cache,
the rank caches that, side by side, store exactly what one full cache stores, the checks made before a
model is split, and the CLI's quiet ranks.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import distributed_worker as worker
from kvslim import SlimCache, distributed
from kvslim.calibration.meancenter import BiasSet

dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip(
        "torch.distributed with the gloo backend is not available in this torch build",
        allow_module_level=True,
    )

WORKER = Path(__file__).with_name("distributed_worker.py")
WORLD = 2
#: seconds a whole group of worker processes may take (each run is ~10 s on an idle 2-core machine)
TIMEOUT = 240
IDENTITY = ["none", "none+stream", "none/kvslim"]
LOSSY = [name for name in worker.CASES if name not in IDENTITY]


def tiny_llama_config():
    import transformers as tf

    return tf.LlamaConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=32,
        max_position_embeddings=4096,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    )


def save_word_tokenizer(path: Path, vocab_size: int = 256) -> None:
    """A word-level tokenizer (every whitespace-separated word ``w3`` ... is one token; ``<unk>``, ``<eos>``,
    ``<bos>`` are 0, 1, 2 as in :func:`tiny_llama_config`), saved beside a model: what the CLI loads."""
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers import models as tok_models
    from transformers import PreTrainedTokenizerFast

    # the special tokens are not word prefixes: "t1" as eos would be cut out of "t12" before the split
    vocab = {"<unk>": 0, "<eos>": 1, "<bos>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    tok = Tokenizer(tok_models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<eos>", bos_token="<bos>", unk_token="<unk>"
    )
    fast.save_pretrained(path)


def save_tiny(path: Path, config) -> Path:
    import transformers as tf

    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # decisive logits: a greedy token flips only on a real difference
    model.save_pretrained(path)
    save_word_tokenizer(path, config.vocab_size)
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """The tiny Llama (4 KV heads) saved with a word-level tokenizer: the workers load its weights, the CLI
    both."""
    return save_tiny(tmp_path_factory.mktemp("tiny-llama"), tiny_llama_config())


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(model_dir: Path, out: Path, world: int, *extra: str) -> list[dict]:
    """Run the worker as ``world`` processes with torchrun's environment; their records, by rank.

    One thread per process (torchrun's default too): on a small machine the processes otherwise fight over
    the cores. A failed or hung group fails the test with every rank's exit status and last output."""
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(world))
    procs = []
    for rank in range(world):
        log = open(out / f"rank{rank}.log", "wb")  # noqa: SIM115 - closed below
        rank_env = dict(env, RANK=str(rank), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
        if world == 1:
            for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_PORT"):
                rank_env.pop(key)
        cmd = [sys.executable, str(WORKER), str(model_dir), str(out), *extra]
        procs.append((subprocess.Popen(cmd, env=rank_env, stdout=log, stderr=subprocess.STDOUT), log))
    deadline = time.monotonic() + TIMEOUT
    codes = []
    try:
        for proc, _ in procs:
            codes.append(proc.wait(timeout=max(1.0, deadline - time.monotonic())))
    except subprocess.TimeoutExpired:
        codes = None
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    if codes is None or any(codes):
        tails = []
        for rank in range(world):
            text = (out / f"rank{rank}.log").read_text(errors="replace").splitlines()
            tails.append(f"--- rank {rank} ---\n" + "\n".join(text[-25:]))
        status = "timed out" if codes is None else ", ".join(_exit_status(c) for c in codes)
        pytest.fail(f"{world} worker process(es): {status}\n" + "\n".join(tails))
    return [torch.load(out / f"rank{rank}.pt", weights_only=False) for rank in range(world)]


def _exit_status(code: int) -> str:
    return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit {code}"


@pytest.fixture(scope="module")
def single_record(model_dir, tmp_path_factory) -> dict:
    """The worker's record from one process holding the whole model."""
    return launch(model_dir, tmp_path_factory.mktemp("single"), 1)[0]


@pytest.fixture(scope="module")
def tp_records(model_dir, tmp_path_factory) -> list[dict]:
    """The worker's records from 2 tensor-parallel processes, by rank."""
    records = launch(model_dir, tmp_path_factory.mktemp("tp"), WORLD)
    assert [r["world"] for r in records] == [WORLD] * WORLD
    return records


@pytest.fixture(scope="module")
def reference(single_record) -> dict:
    """The cases through one process holding the whole model."""
    return single_record["cases"]


@pytest.fixture(scope="module")
def ranks(tp_records) -> list[dict]:
    """The cases through 2 tensor-parallel processes: each rank's record."""
    return [r["cases"] for r in tp_records]


# -- tensor parallel, 2 processes ------------------------------------------------------------------


@pytest.mark.slow
def test_tp_ranks_hold_contiguous_head_blocks(reference, ranks):
    """rank_kv_heads reads the k_proj shard: rank 0 heads 0-1, rank 1 heads 2-3; and what a rank stores in
    layer 0 (whose input is the replicated embedding) is exactly those heads of the single process's keys."""
    assert [r["none"]["kv_heads"] for r in ranks] == [[0, 1], [2, 3]]
    full_k, full_v = reference["none"]["k0"], reference["none"]["v0"]  # (1, 4, T, 32)
    for r in ranks:
        heads = r["none"]["kv_heads"]
        assert r["none"]["k0"].shape == (1, 2, *full_k.shape[2:])
        assert torch.equal(r["none"]["k0"], full_k[:, heads])
        assert torch.equal(r["none"]["v0"], full_v[:, heads])


@pytest.mark.slow
def test_tp_model_fingerprint_is_the_single_process_one(single_record, tp_records):
    """model_fingerprint gathers each sharded weight (a DTensor: .numpy() fails on it) and so gives every rank
    the fingerprint of the whole model, which a bias file's check compares against."""
    assert single_record["fingerprint"].startswith("sha256:")
    assert [r["fingerprint"] for r in tp_records] == [single_record["fingerprint"]] * WORLD


@pytest.mark.slow
@pytest.mark.parametrize("name", IDENTITY)
def test_tp_identity_cache_gives_the_single_process_logits(reference, ranks, name):
    ref = reference[name]
    for r in ranks:
        assert r[name]["tokens"] == ref["tokens"]
        torch.testing.assert_close(r[name]["logits"], ref["logits"], atol=1e-5, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("name", LOSSY)
def test_tp_lossy_cache_gives_the_single_process_tokens(reference, ranks, name):
    for r in ranks:
        assert r[name]["tokens"] == reference[name]["tokens"]
        # the teacher-forced argmax too: every scored position, not just the greedy path
        assert torch.equal(r[name]["logits"].argmax(-1), reference[name]["logits"].argmax(-1))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(worker.CASES))
def test_tp_bytes_of_the_ranks_add_up(reference, ranks, name):
    """live_nbytes (stored tokens, K/V codes, scales, residual, sinks, bias) sums exactly; nbytes also counts
    what each rank holds a copy of (RoPE frequencies, per-row state), so its sum exceeds the single process's
    by (ranks - 1) of those copies. reduce_nbytes gives every rank the sum."""
    ref = reference[name]
    assert sum(r[name]["live_nbytes"] for r in ranks) == ref["live_nbytes"]
    replicated = [r[name]["components"]["rotary"] + r[name]["components"]["row_state"] for r in ranks]
    assert sum(r[name]["nbytes"] for r in ranks) - sum(replicated[1:]) == ref["nbytes"]
    for r in ranks:
        assert r[name]["nbytes_sum"] == sum(x[name]["nbytes"] for x in ranks)
        assert r[name]["live_nbytes_sum"] == ref["live_nbytes"]


# -- layer split, 1 process ------------------------------------------------------------------------


@pytest.mark.slow
def test_layer_split_model_gives_the_whole_model_results(model_dir, tmp_path, reference):
    (record,) = launch(model_dir, tmp_path, 1, "--split", "--cases", "none,q8_0+stream,q8_0+center/kvslim")
    assert record["device_map"]["model.layers.1"] == "disk"  # the model really is split
    for name, got in record["cases"].items():
        assert got["tokens"] == reference[name]["tokens"]
        assert torch.equal(got["logits"], reference[name]["logits"])  # the same CPU arithmetic
        assert got["nbytes"] == reference[name]["nbytes"]
        # each layer's store lives where its layer's keys were computed: the CPU, for the disk-offloaded one too
        assert got["devices"] == ["cpu", "cpu"]


# -- the CLI under torchrun, 2 processes -----------------------------------------------------------

#: seconds one torchrun of the CLI may take (~10-15 s on a busy 2-core machine)
CLI_TIMEOUT = 120
PROMPT = "w5 w17 w42 w99"


def torchrun(*argv: str, world: int = WORLD) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc-per-node WORLD -m kvslim.cli ARGV`` (torchrun as ``python -m
    torch.distributed.run``, so the venv's), offline, one thread per process; its stdout and stderr."""
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"]
    cmd += ["-m", "kvslim.cli", *argv]
    try:
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=CLI_TIMEOUT)
    except subprocess.TimeoutExpired as e:
        pytest.fail(
            f"torchrun ran past {CLI_TIMEOUT} s\n--- stdout ---\n{e.stdout}\n--- stderr ---\n{e.stderr}"
        )


def alone(capsys, *argv: str) -> tuple[int, str, str]:
    """The same command in this process, alone: exit code, stdout, stderr."""
    from kvslim.cli import main

    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def kvslim_lines(stderr: str) -> list[str]:
    """kvslim's own stderr lines (torchrun adds its launcher's log and its "kvslim.cli FAILED" report)."""
    return [line for line in stderr.splitlines() if line.startswith(("kvslim:", "kvslim sample |"))]


@pytest.mark.slow
def test_torchrun_sample_prints_the_single_process_text_once(model_dir, tmp_path, capsys):
    """Greedy int8 (group 4 / residual 4, so tokens are really encoded) over 2 ranks: the single process's
    text, printed once (rank 0); the banner and report once; the report's bytes summed over the ranks."""
    argv = ["sample", "--model", str(model_dir), "--prompt", PROMPT, "--tokens", "8", "--temperature", "0"]
    argv += ["--kv-quantize", "int8", "--kv-group-size", "4", "--kv-residual", "4", "--ignore-eos"]
    code, text, err = alone(capsys, *argv, "--report-json", str(tmp_path / "one.json"))
    assert code == 0, err
    assert len(text.split()) == 8  # eight words, one per token
    run = torchrun(*argv, "--report-json", str(tmp_path / "tp.json"))
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout == text
    lines = kvslim_lines(run.stderr)
    assert sum(line.startswith("kvslim sample |") for line in lines) == 1
    assert sum("tokens seen 11 | tokens stored 11" in line for line in lines) == 1  # 4 + 8, the last unstored
    assert sum(" across 2 ranks" in line for line in lines) == 1
    assert "[rank1]" not in run.stderr and "Traceback" not in run.stderr
    one, tp = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("one", "tp"))
    assert tp["ranks"] == WORLD and "ranks" not in one
    assert tp["live_bytes"] == one["live_bytes"] and tp["tokens_stored"] == one["tokens_stored"]
    assert tp["fp16_full_cache_bytes"] == one["fp16_full_cache_bytes"]


@pytest.mark.slow
def test_torchrun_sampling_without_a_seed_draws_alike_on_every_rank(model_dir):
    """--temperature 0.8 and no --seed: rank 0 draws the seed and broadcasts it (fresh entropy per rank would
    split the ranks apart); the run ends with the ranks' tokens compared (kvslim.distributed.agree), so a clean
    exit means every rank drew the same 8 tokens."""
    argv = ["sample", "--model", str(model_dir), "--prompt", PROMPT, "--tokens", "8", "--temperature", "0.8"]
    run = torchrun(*argv, "--ignore-eos")
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip()  # (a special token drawn prints nothing: the words may be fewer than 8)
    lines = kvslim_lines(run.stderr)
    assert sum("generated 8 tokens" in line for line in lines) == 1
    assert sum(" across 2 ranks" in line for line in lines) == 1


@pytest.mark.slow
def test_torchrun_eval_ppl_gives_the_single_process_numbers(model_dir, tmp_path, capsys):
    """eval ppl over 2 ranks: the reference's perplexity to 1e-5 (the row-wise all-reduce adds in another
    order: logits differ by ~1e-6; 2e-8 relative measured), int8's to 1e-4 and the same top-1 agreement (1.2e-7
    measured on this text, but int8 codes can round those 1e-6 differences into a step: 1.5e-5 seen on a
    longer text), the table printed once."""
    words = " ".join(f"w{3 + (i * 37 + 11) % 253}" for i in range(96))
    (tmp_path / "text.txt").write_text(words)
    argv = ["eval", "ppl", "--model", str(model_dir), "--text", str(tmp_path / "text.txt"), "--prefill", "16"]
    argv += ["--config", "int8,group=4,residual=4", "--no-progress"]
    code, table, err = alone(capsys, *argv, "--json", str(tmp_path / "one.json"))
    assert code == 0, err
    run = torchrun(*argv, "--json", str(tmp_path / "tp.json"))
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.count("config") == 1 and run.stdout.count("\nnone ") == 1  # one table
    assert len(run.stdout.splitlines()) == len(table.splitlines())
    assert sum(line.startswith("kvslim: warning:") for line in kvslim_lines(run.stderr)) <= 1
    one, tp = (json.loads((tmp_path / f"{n}.json").read_text())["results"] for n in ("one", "tp"))
    assert [r["config"] for r in tp] == [r["config"] for r in one] == ["none", "int8,group=4,residual=4"]
    assert tp[0]["ppl"] == pytest.approx(one[0]["ppl"], rel=1e-5)
    assert tp[1]["ppl"] == pytest.approx(one[1]["ppl"], rel=1e-4)
    assert [r["top1"] for r in tp] == [r["top1"] for r in one]
    assert [r["scored_tokens"] for r in tp] == [r["scored_tokens"] for r in one]


@pytest.mark.slow
def test_torchrun_refuses_a_model_it_cannot_split(tmp_path):
    """3 KV heads over 2 ranks: one kvslim error line (rank 0's; rank 1's is the same and stays quiet), checked
    on the config before the weights load, and the run ends (torchrun's own report follows)."""
    config = tiny_llama_config()
    config.num_attention_heads, config.num_key_value_heads, config.hidden_size = 6, 3, 192
    path = save_tiny(tmp_path / "three-heads", config)
    run = torchrun("sample", "--model", str(path), "--prompt", PROMPT, "--tokens", "2")
    assert run.returncode != 0 and run.stdout == ""
    (line,) = kvslim_lines(run.stderr)
    assert line.startswith("kvslim: error: the model's 3 KV heads do not split over 2 ranks")


# -- in process: the pieces ------------------------------------------------------------------------


def _keys(heads: int = 4, tokens: int = 24, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(1, heads, tokens, 32, generator=g) + 1.5  # an offset for the bias to remove
    v = torch.randn(1, heads, tokens, 32, generator=g)
    return k, v


def _bias():
    return worker.bias_for(tiny_llama_config())


def test_a_full_width_bias_is_refused_on_a_rank_with_fewer_heads():
    """What breaks without kvslim.distributed: a cache built from the model's config expects 4 KV heads'
    bias; a rank's layer hands it 2 heads, and the first encode says so instead of broadcasting wrongly."""
    cache = SlimCache(
        kv_quantize="q8_0",
        group_size=4,
        residual=4,
        mean_center=_bias(),
        config=tiny_llama_config(),
        compressed_attention=False,
    )
    k, v = _keys()
    with pytest.raises(ValueError, match=r"bias has shape \(4, 32\) but the tokens have 2 KV heads"):
        cache.update(k[:, :2], v[:, :2], 0)


@pytest.mark.parametrize("spec", [dict(kv_quantize="q4_0"), dict(kv_quantize="q8_0", sink=2, window=12)])
def test_rank_caches_side_by_side_store_what_one_cache_stores(spec):
    """Two caches built for heads 0-1 and 2-3 (rank_config + shard_bias, what rank_cache does on a sharded
    model), each fed its heads, read back exactly the full cache's heads; their live bytes add up."""
    config = tiny_llama_config()
    kwargs = dict(group_size=4, residual=4, mean_center=_bias(), compressed_attention=False, **spec)
    full = SlimCache(config=config, **kwargs)
    parts = [range(0, 2), range(2, 4)]
    shards = []
    for heads in parts:
        shard_kwargs = dict(kwargs, mean_center=distributed.shard_bias(kwargs["mean_center"], config, heads))
        shards.append(SlimCache(config=distributed.rank_config(config, heads), **shard_kwargs))
    k, v = _keys()
    for start in range(0, k.shape[2], 6):  # chunks of 6: encodes, evicts with the window
        chunk = slice(start, start + 6)
        for layer in range(2):
            full.update(k[:, :, chunk], v[:, :, chunk], layer)
            for heads, cache in zip(parts, shards):
                cache.update(
                    k[:, heads.start : heads.stop, chunk], v[:, heads.start : heads.stop, chunk], layer
                )
    for layer in range(2):
        want_k, want_v = full.stores()[layer].read(torch.float32)
        for heads, cache in zip(parts, shards):
            got_k, got_v = cache.stores()[layer].read(torch.float32)
            assert torch.equal(got_k, want_k[:, heads.start : heads.stop])
            assert torch.equal(got_v, want_v[:, heads.start : heads.stop])
    assert sum(c.live_nbytes() for c in shards) == full.live_nbytes()


def test_rank_config_describes_one_rank_and_leaves_the_model_config_alone():
    config = tiny_llama_config()
    config.num_attention_heads, config.num_key_value_heads = 8, 4  # GQA: 2 query heads per KV head
    config.head_dim = None  # derived: hidden 128 / 8 heads = 16
    one = distributed.rank_config(config, range(3, 4))
    assert (one.num_key_value_heads, one.num_attention_heads, one.head_dim) == (1, 2, 16)
    assert (config.num_key_value_heads, config.num_attention_heads, config.head_dim) == (4, 8, None)


def test_shard_bias_keeps_the_basis_and_slices_every_layer():
    full = BiasSet(_bias(), k_rot=True, cache_type="q8_0")
    cut = distributed.shard_bias(full, tiny_llama_config(), range(1, 3))
    assert cut.k_rot and not cut.pre_rope and cut.cache_type == "q8_0"
    assert [tuple(t.shape) for t in cut.tensors] == [(2, 32), (2, 32)]
    for t, whole in zip(cut.tensors, full.tensors):
        assert torch.equal(t, whole[1:3])


def test_shard_bias_slices_the_fitted_rotations_and_rank_caches_store_what_one_fitted_cache_stores(tmp_path):
    """A schema-2 set's rotations (one (H_kv, D, D) per layer and role) cut to a rank's heads, from a BiasSet and
    from its file alike; caches for heads 0-1 and 2-3 with rotate='fitted', fed their heads, read back exactly
    the full cache's heads (a rotation acts within a head)."""
    from kvslim.calibration.biasfile import write_bias_file

    config = tiny_llama_config()
    g = torch.Generator().manual_seed(5)
    rot = {
        role: [torch.linalg.qr(torch.randn(4, 32, 32, generator=g, dtype=torch.float64))[0].float() for _ in range(2)]
        for role in "kv"
    }  # (H_kv, D, D) orthogonal, a different matrix per head
    full_set = BiasSet(_bias(), rotations=rot, rotation="pca-hadamard")
    path = tmp_path / "fit.gguf"
    write_bias_file(path, full_set)
    for source in (full_set, path):
        cut = distributed.shard_bias(source, config, range(1, 3))
        assert cut.rotation == "pca-hadamard" and set(cut.rotations) == {"k", "v"}
        for role in "kv":
            for mine, whole in zip(cut.rotations[role], rot[role], strict=True):
                assert torch.equal(mine, whole[1:3])
    assert distributed.shard_bias(BiasSet(_bias()), config, range(1, 3)).rotations is None  # schema 1: none
    kwargs = dict(kv_quantize="int4", rotate="fitted", group_size=4, residual=4, compressed_attention=False)
    full = SlimCache(config=config, mean_center=full_set, **kwargs)
    parts = [range(0, 2), range(2, 4)]
    shards = [
        SlimCache(
            config=distributed.rank_config(config, heads),
            mean_center=distributed.shard_bias(full_set, config, heads),
            **kwargs,
        )
        for heads in parts
    ]
    assert all(c.rotate == "fitted" for c in (full, *shards))
    k, v = _keys()
    for start in range(0, k.shape[2], 6):
        chunk = slice(start, start + 6)
        for layer in range(2):
            full.update(k[:, :, chunk], v[:, :, chunk], layer)
            for heads, cache in zip(parts, shards):
                cache.update(k[:, heads.start : heads.stop, chunk], v[:, heads.start : heads.stop, chunk], layer)
    for layer in range(2):
        want_k, want_v = full.stores()[layer].read(torch.float32)
        assert full.stores()[layer].k.n_body > 0
        for heads, cache in zip(parts, shards):
            got_k, got_v = cache.stores()[layer].read(torch.float32)
            torch.testing.assert_close(got_k, want_k[:, heads.start : heads.stop], atol=1e-6, rtol=1e-6)
            torch.testing.assert_close(got_v, want_v[:, heads.start : heads.stop], atol=1e-6, rtol=1e-6)
    assert sum(c.rotation_nbytes() for c in shards) == full.rotation_nbytes() == 2 * 2 * 4 * 32 * 32 * 4


def test_helpers_without_a_process_group(model_dir):
    """Not distributed: every head, the local bytes, rank 0 — and rank_cache is a plain SlimCache."""
    import transformers as tf

    assert not dist.is_initialized()
    model = tf.AutoModelForCausalLM.from_pretrained(model_dir)
    assert distributed.rank_kv_heads(model) == range(4)
    assert distributed.is_main_process()
    cache = distributed.rank_cache(model, kv_quantize="q8_0", mean_center=_bias(), compressed_attention=False)
    cache.update(*_keys(), 0)
    assert distributed.reduce_nbytes(cache) == cache.nbytes()
    assert distributed.reduce_nbytes(cache, live=True) == cache.live_nbytes()
    with pytest.raises(ValueError, match="config"):
        distributed.rank_cache(model, config=model.config)


def test_check_tensor_parallel_refuses_what_cannot_be_split():
    import transformers as tf

    config = tiny_llama_config()  # 4 query and 4 KV heads
    distributed.check_tensor_parallel(config, 2)
    distributed.check_tensor_parallel(config, 4)
    with pytest.raises(ValueError, match=r"4 KV heads do not split over 3 ranks.*in \{2, 4\}"):
        distributed.check_tensor_parallel(config, 3)
    phi3 = tf.Phi3Config(hidden_size=128, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=2)
    with pytest.raises(ValueError, match="no separate k_proj"):
        distributed.check_tensor_parallel(phi3, 2)
    mla = tf.DeepseekV3Config(
        hidden_size=128, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=2, q_lora_rank=32,
        kv_lora_rank=64, qk_nope_head_dim=16, qk_rope_head_dim=32, v_head_dim=16,
    )  # fmt: skip
    with pytest.raises(ValueError, match="MLA"):
        distributed.check_tensor_parallel(mla, 2)
    plain = tiny_llama_config()
    plain.base_model_tp_plan = None
    with pytest.raises(ValueError, match="no tensor-parallel plan"):
        distributed.check_tensor_parallel(plain, 2)


def test_run_helpers_without_a_process_group(monkeypatch, tmp_path):
    """Alone: the seed as given, the report as it is; a device torch cannot run ranks on is refused before any
    group is joined; a tensor-parallel load without a group is refused."""
    from kvslim.models import load_model

    assert distributed.shared_seed(None) is None and distributed.shared_seed(7) == 7
    assert distributed.agree(5)
    report = {"cache_bytes": 10, "live_bytes": 8, "fp16_full_cache_bytes": 20, "components": {}}
    assert distributed.reduce_report(report) is report
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert (distributed.env_world_size(), distributed.env_rank()) == (1, 0)
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(ValueError, match="WORLD_SIZE='two'"):
        distributed.env_world_size()
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="ask for 'cpu'"):
            distributed.init_from_env("cuda")
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="init_from_env"):
        load_model(tmp_path, tensor_parallel=True)  # refused before the directory is read


@pytest.mark.parametrize("rank", ["0", "1"])
def test_cli_rank_other_than_0_is_quiet(monkeypatch, capfd, rank):
    """Under torchrun's environment an error every rank meets alike (here a bad flag, before any process group)
    is printed by rank 0 alone; rank 1's stdout and stderr are /dev/null for the run and restored after."""
    from kvslim.cli import main

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")  # as torchrun sets them (without them: not a torchrun launch)
    monkeypatch.setenv("MASTER_PORT", "29500")
    code = main(["sample", "--prompt", "hi", "--tokens", "0"])
    out, err = capfd.readouterr()
    assert code == 2 and out == ""
    if rank == "0":
        assert err == "kvslim: error: --tokens must be >= 1, got 0\n"
    else:
        assert err == ""
    print("after")  # the descriptors are back
    assert capfd.readouterr().out == "after\n"


def test_cli_gloo_message_is_cut_to_its_cause():
    from kvslim.cli import _first_sentence

    text = (
        "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:8069: "
        "Connection reset by peer. This is typically caused by a remote worker hanging. GLHF!"
    )
    assert _first_sentence(text) == "Read error [127.0.0.1]:8069: Connection reset by peer"
