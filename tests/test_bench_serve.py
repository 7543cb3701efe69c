"""Issue 30, items 5-7: the thread policy (kvslim.threads and the CLI flags), ``kvslim bench --concurrency
--serve`` against a real ``kvslim serve`` child on the tiny model, the serving peers skipped cleanly when
their venvs are absent, and the server's per-step hand-over. Timings are never asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import save_tiny_word_model
from kvslim import threads

# -- the thread policy ---------------------------------------------------------------------------


def test_wait_policy_choice():
    assert threads.choose_wait(None, {}) == ("PASSIVE", "kvslim default")
    assert threads.choose_wait("auto", {"OMP_WAIT_POLICY": "active"}) == ("ACTIVE", "environment")
    assert threads.choose_wait("active", {}) == ("ACTIVE", "--omp-wait")
    assert threads.choose_wait("runtime", {}) == ("", "--omp-wait")
    assert threads.choose_wait("passive", {"OMP_WAIT_POLICY": "PASSIVE"}) == ("PASSIVE", "--omp-wait")
    with pytest.raises(ValueError, match="contradicts OMP_WAIT_POLICY=ACTIVE"):
        threads.choose_wait("passive", {"OMP_WAIT_POLICY": "ACTIVE"})
    with pytest.raises(ValueError, match="contradicts"):
        threads.choose_wait("runtime", {"OMP_WAIT_POLICY": "PASSIVE"})
    with pytest.raises(ValueError, match="--omp-wait must be one of auto, passive, active, runtime, got 'spin'"):
        threads.choose_wait("spin", {})


def test_the_workers_spin_from_the_environment():
    assert threads.spin_from_env({}) is None and threads.spin_from_env({"KVSLIM_POOL_SPIN_US": " "}) is None
    assert threads.spin_from_env({"KVSLIM_POOL_SPIN_US": "0"}) == 0
    assert threads.spin_from_env({"KVSLIM_POOL_SPIN_US": " 250 "}) == 250
    for bad in ("abc", "-1", "100001", "2.5"):
        with pytest.raises(ValueError, match=f"KVSLIM_POOL_SPIN_US={bad} must be a whole number of microseconds"):
            threads.spin_from_env({"KVSLIM_POOL_SPIN_US": bad})
    with pytest.raises(ValueError, match="KVSLIM_POOL_SPIN_US=x must be"):  # refused where the CLI sets its policy
        threads.prepare("serve", [], {"KVSLIM_POOL_SPIN_US": "x"})


def test_prepare_sets_the_environment_only_where_unset_and_only_for_its_commands():
    env: dict = {}
    policy = threads.prepare("bench", ["--concurrency", "2", "--threads", "3"], env)
    assert env == {"OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": "3"}
    assert policy.threads == 3 and policy.wait_source == "kvslim default"
    env = {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "active"}
    threads.prepare("serve", ["--threads=2", "--omp-wait", "auto"], env)
    assert env == {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "active"}  # the user's environment wins
    env = {}
    threads.prepare("serve", ["--omp-wait", "runtime"], env)
    assert env == {}  # the runtime's own default: left unset
    assert threads.prepare("sample", ["--threads", "2"], env) is None and env == {}
    env = {}
    threads.prepare("bench", ["--threads", "x"], env)  # the subcommand's parser reports it
    assert env == {"OMP_WAIT_POLICY": "PASSIVE"}


def _cli(*argv, env=None, timeout=300):
    full = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    full = {k: v for k, v in full.items() if v is not None}
    return subprocess.run([sys.executable, "-m", "kvslim.cli", *argv], capture_output=True, text=True,
                          timeout=timeout, env=full, stdin=subprocess.DEVNULL)


def test_the_policy_is_set_before_torch_loads_and_reported():
    """In a fresh process the CLI sets OMP_WAIT_POLICY before torch (and its OpenMP runtime) loads."""
    code = (
        "import os, sys\n"
        "from kvslim import threads\n"
        "p = threads.prepare('bench', ['--threads', '1'])\n"
        "import torch\n"
        "d = threads.describe(p)\n"
        "print(p.before_torch, d['omp_wait_policy'], d['wait_source'], d['torch_threads'])\n"
        "print(threads.banner(d))\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    first, banner = out.stdout.splitlines()[:2]
    assert first == "True PASSIVE kvslim default 1", out.stderr
    assert banner.startswith("threads: 1 torch threads of") and "OMP_WAIT_POLICY PASSIVE (kvslim default)" in banner


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_word_model(tmp_path_factory.mktemp("tiny"))


@pytest.mark.parametrize(
    "argv, env, message",
    [
        (["--omp-wait", "spin"], {}, "--omp-wait must be one of auto, passive, active, runtime"),
        (["--omp-wait", "active"], {"OMP_WAIT_POLICY": "PASSIVE"}, "contradicts OMP_WAIT_POLICY=PASSIVE"),
        (["--serve"], {}, "--serve measures many streams through the server: give --concurrency"),
        (["--peers", "openvino"], {}, "--peers openvino: not a peer of the single-stream bench"),
        (["--concurrency", "2", "--peers", "quanto"], {}, "--peers quanto: not a peer of --concurrency"),
        (["--threads", "0"], {}, "--threads must be an integer >= 1"),
        (["--gc-freeze", "maybe"], {}, "argument --gc-freeze: invalid choice: 'maybe'"),
        (["--concurrency", "2", "--join", "64"], {}, "--join 64: a prompt length of at least 1 token, with --serve"),
        (["--concurrency", "2", "--serve", "--prefill-chunk", "0"], {}, "--prefill-chunk 0: a chunk of at least 1"),
        (["--pages"], {}, "--pages applies to --concurrency's engine rows"),
        (["--compile", "cpp"], {}, "--compile cpp: a wrapper applies to the compiled paged step (--concurrency C"),
        (["--compile", "c++"], {}, "argument --compile: invalid choice: 'c++' (choose from 'python', 'cpp')"),
        ([], {"KVSLIM_POOL_SPIN_US": "-5"}, "KVSLIM_POOL_SPIN_US=-5 must be a whole number of microseconds 0-100000"),
    ],
)
def test_bad_flags_are_one_line(model_dir, argv, env, message):
    out = _cli("bench", "--model", str(model_dir), *argv, env={"OMP_WAIT_POLICY": None, **env})
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], out.stderr


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--pages", "0"], "argument --pages: expected a positive number of pages or auto, got '0'"),
        (["--pages", "64", "--memory-budget", "1GiB"], "--pages N is the pool's size, which is its memory budget"),
        (["--pages", "auto", "--session-dir", "sessions"], "--pages keeps idle sessions in memory only"),
        (["--compile"], "--compile compiles the paged step: give --pages N or --pages auto as well"),
        (["--compile", "cpp"], "--compile compiles the paged step: give --pages N or --pages auto as well"),
        (["--pages", "auto", "--compile", "c"], "argument --compile: invalid choice: 'c' (choose from 'python', 'cpp')"),
        (["--no-warm-up"], "--no-warm-up goes with --compile"),
    ],
)
def test_serve_rejects_bad_pages_flags(model_dir, argv, message):
    out = _cli("serve", "--model", str(model_dir), *argv)
    assert out.returncode == 2 and message in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "flags, way_out",
    [(["--compile"], "(run without --compile)"), (["--compile", "cpp"], "(run with --compile python, or without --compile)")],
)
def test_serve_says_in_one_line_when_the_warm_up_compile_fails(model_dir, tmp_path, flags, way_out):
    """A compile that fails at warm-up (here Inductor finds no working C++ compiler: CXX=/bin/false, and a cache of
    its own, so no kernel compiled before is loaded instead) stops the start before the port opens: exit 2, one
    error line naming the row count and the way out, no traceback."""
    env = {"CXX": "/bin/false", "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    out = _cli("serve", "--model", str(model_dir), "--pages", "auto", *flags, "--port", "9", env=env, timeout=240)
    assert out.returncode == 2, out.stderr[-3000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("kvslim: error: --compile: compiling the paged step for 1 row(s) failed: "), last
    assert last.endswith(way_out) and "C++ compiler" in last, last
    assert "Traceback" not in out.stderr and "serving" not in out.stderr, out.stderr[-3000:]


def test_serve_rejects_bad_thread_flags(model_dir):
    out = _cli("serve", "--model", str(model_dir), "--threads", "0")
    assert out.returncode == 2 and "--threads must be >= 1, got 0" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


# -- kvslim bench --serve ------------------------------------------------------------------------


def test_decode_window():
    from kvslim.bench.serve import decode_window

    recs = [{"times_s": [1.0, 1.1, 1.2, 1.3, 1.4]}, {"times_s": [1.05, 1.15, 1.25, 1.35]}]
    w = decode_window(recs, warmup=1)
    assert w["start"] == pytest.approx(1.15) and w["end"] == pytest.approx(1.35)
    assert w["chunks"] == 2 + 2  # (1.15, 1.35]: 1.2, 1.3 of the first; 1.25, 1.35 of the second
    assert len(w["gaps"]) == 1 + 2 and all(g == pytest.approx(0.1) for g in w["gaps"])
    assert decode_window([{"times_s": [1.0, 2.0]}], warmup=1) is None  # too short to leave a window
    assert decode_window([{"times_s": [1.0, 1.1, 1.2]}, {"times_s": [3.0, 3.1, 3.2]}], warmup=0) is None
    # an overlap with no two chunks of one stream inside it: no gap, no window (CI once rendered its None as a step)
    assert decode_window([{"times_s": [0.0, 2.0, 5.0]}, {"times_s": [0.0, 1.0, 3.0]}], warmup=1) is None


@pytest.mark.slow
def test_bench_serve_drives_a_real_server(model_dir, tmp_path):
    """A short real run: the engine rows and the same specs through a `kvslim serve` child, 2 streams each; with
    --pages the spec pages can store also in pages, in the bench and through a `kvslim serve --pages auto` child."""
    pytest.importorskip("uvicorn")
    pytest.importorskip("httpx")
    out_json = tmp_path / "bench.json"
    out = _cli("bench", "--model", str(model_dir), "--concurrency", "2", "--lengths", "16", "--steps", "4",
               "--warmup", "1", "--config", "int4", "none,sink=4,window=8", "--serve", "--no-continuous-batching",
               "--threads", "1", "--json", str(out_json), "--quiet", "--join", "300", "--prefill-chunk", "64", "--pages",
               timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("threads: 1 torch threads of")
    data = json.loads(out_json.read_text())
    rows = {r["mode"]: r for r in data["concurrency"]}
    assert set(rows) == {"dynamic", "int4", "none,sink=4,window=8", "int4 via serve", "none,sink=4,window=8 via serve",
                         "int4+pages", "int4+pages via serve"}
    assert "window=8 in kvslim pages keeps every key" in data["pages_refused"]["none,sink=4,window=8"]
    with open(data["serve_pages_logs"][0]) as f:
        assert "--pages auto" in f.read()
    for mode in ("int4 via serve", "none,sink=4,window=8 via serve", "int4+pages via serve"):
        r = rows[mode]
        assert r["kind"] == "serve" and r["concurrency"] == 2 and r["length"] == 16
        assert r["aggregate_tok_s"] > 0 and r["itl_p50_ms"] <= r["itl_p90_ms"] <= r["itl_p99_ms"]
        assert r["ttft_p50_ms"] > 0 and r["ratio_to_dynamic"] > 0
        assert "sessions continued 2/2" in r["note"]  # the decode phase continued each prefilled session
        assert r["bytes_per_stream"] > 0
    assert rows["int4"]["itl_p50_ms"] == pytest.approx(rows["int4"]["ms_median"])
    policy = data["thread_policy"]
    assert policy["omp_wait_policy"] == "PASSIVE" and policy["torch_threads"] == 1
    assert "load_average_after" in policy and data["settings"]["serve"] is True
    assert os.path.exists(data["serve_log"])
    # the startup heap frozen in both processes (kvslim.heap): the bench's engine rows and the server's
    assert data["gc"]["freeze"] == "on" and len(data["gc"]["passes"]) == 3 and len(data["gc"]["ms"]) == 3
    with open(data["serve_log"]) as f:
        log = f.read()
    assert "startup objects frozen out of the collector's passes" in log, log[-2000:]  # --gc-freeze passed on
    assert data["gc"]["frozen_objects"] > 0
    with open(data["serve_log"]) as f:
        log = f.read()
    assert "--omp-wait auto" in log and "threads: 1 torch threads" in log  # the server ran the bench's policy
    assert "--prefill-chunk 64" in log  # ... and its chunk
    joins = {j["spec"]: j for j in data["serve_join"]}  # a 300-token prompt joined each spec's 2 streams
    assert set(joins) == {"int4", "none,sink=4,window=8", "int4+pages"}
    assert "joining prompt through kvslim serve" in out.stdout
    for j in joins.values():
        assert j["join_tokens"] == 300 and j["chunk"] == 64 and j["chunks"] == 5 and not j["note"], j
        assert j["gaps_during"] >= 2 and j["itl_before_p50_ms"] > 0 and j["join_ttft_ms"] > 0
        assert j["itl_during_p50_ms"] <= j["itl_during_max_ms"] and j["extra_per_chunk_ms"] is not None


def test_join_gaps_split_at_the_join_and_sum_per_chunk():
    from kvslim.bench.join import JoinRow, split_gaps, summarize

    times = [[0.0, 0.1, 0.2, 0.3, 0.5, 0.7, 0.8], [0.05, 0.15, 0.25, 0.45, 0.65, 0.75]]
    before, during = split_gaps(times, start=0.1, sent=0.3, first=0.7)
    assert [round(g, 2) for g in before] == [0.1, 0.1, 0.1]  # 0.1-0.2, 0.2-0.3; 0.15-0.25
    assert sorted(round(g, 2) for g in during) == [0.2, 0.2, 0.2, 0.2]  # 0.3-0.5, 0.5-0.7, 0.25-0.45, 0.45-0.65
    row = summarize(JoinRow("int4", 16, 2, join_tokens=256, chunk=128, chunks=2), before, during)
    assert row.itl_before_p50_ms == pytest.approx(100) and row.itl_during_p50_ms == pytest.approx(200)
    # each stream waited 2 x 100 ms more over 2 chunks: 100 ms a chunk, one step's worth
    assert row.extra_per_chunk_ms == pytest.approx(100) and row.within_one_step
    row = summarize(JoinRow("int4", 16, 2, join_tokens=128, chunk=128, chunks=1), before, during)
    assert row.extra_per_chunk_ms == pytest.approx(200) and not row.within_one_step


# -- the serving peers ------------------------------------------------------------------------------


def test_peer_cache_mapping():
    from kvslim.bench.concurrency_peers import peer_cache

    assert peer_cache("openvino", "none") == ({"kv": "f32", "eviction": None}, "")
    assert peer_cache("openvino", "int4")[0]["kv"] == "u4" and peer_cache("openvino", "q8_0")[0]["kv"] == "u8"
    start, recent, most = peer_cache("openvino", "int4,sink=4,window=1020")[0]["eviction"]
    assert (start, most) == (32, 1024) and most > start + recent
    assert peer_cache("openvino", "int2")[0] is None and peer_cache("openvino", "fp8")[0] is None
    assert peer_cache("vllm", "none") == ({"kv": "auto", "eviction": None}, "")
    # a lossy spec runs as kvslim's pages inside vLLM (the plugin), where a page can store it
    assert peer_cache("vllm", "q4_0") == ({"kv": "auto", "eviction": None, "kvslim": "q4_0"}, "")
    assert peer_cache("vllm", "int4")[0]["kvslim"] == "int4"
    none, why = peer_cache("vllm", "int2")  # int2 K needs per-channel groups, not built in pages
    assert none is None and "per-channel" in why
    assert peer_cache("vllm", "none,sink=4,window=60")[0] is None


def test_missing_peers_are_one_line_each(monkeypatch, tmp_path):
    from conftest import tiny_model
    from kvslim.bench import concurrency_peers as cp

    monkeypatch.setenv("KVSLIM_OPENVINO_VENV", str(tmp_path / "no-openvino"))
    monkeypatch.setenv("KVSLIM_VLLM_VENV", str(tmp_path / "no-vllm"))
    rows, notes = cp.run_peers(["openvino", "vllm"], tiny_model("llama"), ["int4"], lambda n: [3] * n, [16], [2], 2)
    assert rows == []
    assert notes["openvino"] == ("peer openvino: not installed: run `make openvino` (builds .venv-openvino) or set "
                                 "KVSLIM_OPENVINO_VENV")
    assert "run `make vllm`" in notes["vllm"]


@pytest.mark.skipif(not os.path.exists(os.path.join(os.path.dirname(__file__), "..", ".venv-openvino", ".installed")),
                    reason="no .venv-openvino (make openvino)")
@pytest.mark.slow
def test_openvino_peer_when_installed(model_dir):
    """The OpenVINO runner on the tiny model's directory (exported on first use): a row with every column."""
    from conftest import tiny_model
    from kvslim.bench import concurrency_peers as cp

    model = tiny_model("llama")
    model.name_or_path = str(model_dir)
    rows, notes = cp.run_peers(["openvino"], model, ["int4", "int2"], lambda n: [3 + i for i in range(n)],
                               [16], [2], 3, warmup=1, threads=1)
    assert "skipped int2" in notes["openvino"], notes
    assert [r.mode for r in rows] == ["openvino int4"], notes
    assert rows[0].aggregate_tok_s > 0 and rows[0].steps >= 1 and rows[0].note.startswith("KV u4")
    bf = tiny_model("llama").to(torch.bfloat16)
    bf.name_or_path = str(model_dir)
    rows, notes = cp.run_peers(["openvino"], bf, ["int4", "none"], lambda n: [3 + i for i in range(n)], [16], [2], 3,
                               warmup=1, threads=1)
    assert [r.mode for r in rows] == ["openvino int4", "openvino none"], (notes, rows)
    assert "bf16 compute" in rows[0].note and rows[1].note.startswith("KV bf16, bf16 compute"), (notes, rows)
