"""A pool of kvslim pages for many rows (kvslim.cache.pagepool, kvslim.cache.paged_adapter): one write and one
attention call a layer for every row of a step. Lossless pages give the plain forward's logits; every row's logits
are bit for bit the row's stepped alone, whatever shares its step; a step the pool cannot hold, or a forward that
fails, changes no row; what pages cannot store is refused in one line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kvslim
from conftest import family_model, tiny_model
from kvslim.cache.paged_adapter import forward_pages
from kvslim.cache.pagepool import PagePool, check_config, pool_for

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "paged_step.py"


@pytest.fixture(scope="module")
def model():
    return kvslim.enable(tiny_model("llama"))


@pytest.fixture(scope="module")
def route(model):
    """The route the engine takes for the linear layers (``auto``: one whose products round a row alike at any row
    count), so that a row's bits across steps of different sizes do not hang on this CPU's BLAS (MKL rounds a row by
    the row count on some AVX-512 Xeons, even at the filler rows' multiples of 4: conftest's BLAS_ROWS_INVARIANT)."""
    from kvslim.engine.linears import Linears

    return Linears(model, "auto", batch_hint=32)


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_lossless_pages_give_the_plain_forward(model):
    ids = _ids(75, 0)
    with torch.inference_mode():
        ref = model(torch.tensor([ids])).logits[0].float()
        pool = pool_for(model, "none", pages=8, max_rows=2)
        row = pool.new_row()
        got = [forward_pages(model, pool, [(ids[:40], row)])[0]]  # a prompt of one chunk and a page and a bit
        got += [forward_pages(model, pool, [(ids[40:57], row)])[0]]  # a chunk continuing a cached prefix
        # decode steps of one token (no filler rows: the K/V handed on are one-token views, strides (D, D, 1))
        got += [forward_pages(model, pool, [([t], row)], row_multiple=1)[0] for t in ids[57:]]
    want = torch.stack([ref[39], ref[56], *ref[57:]])
    torch.testing.assert_close(torch.stack(got), want, rtol=1e-5, atol=1e-5)
    assert row.length == 75 and len(row.pages) == 3 and pool.free_pages == 5
    assert pool.nbytes(row) == 3 * pool.page_bytes()


def _alone(model, spec: str, prompt: list[int], tokens: list[int]) -> list[torch.Tensor]:
    pool = pool_for(model, spec, pages=16, max_rows=1)
    row = pool.new_row()
    forward_pages(model, pool, [(prompt, row)])
    return [forward_pages(model, pool, [([t], row)])[0] for t in tokens]


@pytest.mark.parametrize(
    ("spec", "lengths"),
    [
        ("none", (37, 64)),
        ("q4_0", (37, 64)),
        ("int4", (37, 64)),
        ("q8_0,sink=32", (37, 64)),
        ("int8,k=q4_0,rotate=none", (37, 64)),
        # rows past their residual: pages leave it (read from their codes from then on) in the mixed steps
        ("q4_0,residual=32,sink=32", (130, 150)),
        ("int4,residual=64", (150, 97)),
        # StreamingLLM in pages: a row's pages leave its window (given back) in the mixed steps
        ("int4,sink=4,window=64,residual=32,positions=original", (130, 150)),
        ("q4_0,sink=40,window=100,residual=0,positions=original", (150, 97)),
    ],
)
def test_each_row_is_bit_for_bit_the_row_alone(model, route, spec, lengths):
    """Three rows: two decoding (one with a staged partial page, one at a page boundary) and one joining with prompt
    chunks in the same steps, plus filler rows: each row's logits equal its run in a pool of its own (the linear
    layers on the engine's route)."""
    a_prompt, b_prompt, c_prompt = _ids(lengths[0], 1), _ids(lengths[1], 2), _ids(50, 3)
    toks = {k: _ids(12, 10 + i) for i, k in enumerate("abc")}
    with torch.inference_mode(), route.routed():
        pool = pool_for(model, spec, pages=40, max_rows=3)
        a, b, c = pool.new_row(), pool.new_row(), pool.new_row()
        forward_pages(model, pool, [(a_prompt, a)])
        forward_pages(model, pool, [(b_prompt, b)])  # a step without a: its sink page stays staged
        got = {k: [] for k in "abc"}
        # c's prompt in chunks of 20, 20, 10 beside a's and b's decode steps (rows in another order each time)
        for step in range(12):
            feeds = [([toks["b"][step]], b), ([toks["a"][step]], a)]
            if step < 3:
                feeds.insert(step % 2, (c_prompt[20 * step : 20 * step + 20], c))
            else:
                feeds.append(([toks["c"][step - 3]], c))
            out = forward_pages(model, pool, feeds, row_multiple=4)
            for i, (_, row) in enumerate(feeds):
                name = "abc"[[a, b, c].index(row)]
                if not (row is c and step < 2):
                    got[name].append(out[i])
        if (
            pool.stager is not None
        ):  # each row stages its sink pages, its residual pages and its partly filled page
            staged = {p for p in range(pool.stager.map.shape[0]) if int(pool.stager.map[p]) >= 0}
            want_staged = set()
            for row in (a, b, c):
                full = row.length // 32
                keep = (
                    row.pages[: pool.sink_pages]
                    + row.pages[max(pool.sink_pages, full - pool.residual_pages) : full]
                )
                want_staged |= set(keep) | ({row.pages[full]} if row.length % 32 else set())
            assert staged == want_staged
            assert pool.stager.free_slots == pool.stager.slots - len(staged)
        want = {
            "a": _alone(model, spec, a_prompt, toks["a"]),
            "b": _alone(model, spec, b_prompt, toks["b"]),
            "c": [],
        }
        pool_c = pool_for(model, spec, pages=16, max_rows=1)
        rc = pool_c.new_row()
        for step in range(3):
            last = forward_pages(model, pool_c, [(c_prompt[20 * step : 20 * step + 20], rc)])[0]
        want["c"] = [last] + [forward_pages(model, pool_c, [([t], rc)])[0] for t in toks["c"][:9]]
    for name in "abc":
        assert len(got[name]) == len(want[name])
        for i, (x, y) in enumerate(zip(got[name], want[name], strict=True)):
            assert torch.equal(x, y), f"{spec}: row {name} step {i} differs from the row alone"


def test_a_long_row_is_bit_for_bit_the_row_alone():
    """A row long enough for the kernel to split its pages (flash-decoding's parts: 4,200 tokens, 132 pages) sums
    them in the same parts alone, beside another row, and at 1, 2 and 3 threads: its logits are the same bits in
    every case (the parts once depended on the step's task count and the threads)."""
    model = kvslim.enable(tiny_model("llama", max_position_embeddings=8192))
    prompt, toks = _ids(4200, 7), _ids(2, 8)
    was, runs = torch.get_num_threads(), []
    try:
        with torch.inference_mode():
            pool = pool_for(model, "int4", pages=4 * 140, max_rows=4)
            src = pool.new_row()
            for s in range(0, len(prompt), 1050):
                forward_pages(model, pool, [(prompt[s : s + 1050], src)])
            for threads in (1, 2, 3):
                torch.set_num_threads(threads)
                rows = [pool.copy_row(src) for _ in range(3)]
                for t in toks:  # alone, then beside another (filler rows pad both: torch's products)
                    runs.append(forward_pages(model, pool, [([t], rows[0])])[0])
                    out = forward_pages(model, pool, [([t], rows[1]), ([t], rows[2])])
                    runs += [out[0], out[1]]
                for r in rows:
                    pool.free(r)
    finally:
        torch.set_num_threads(was)
    # each thread count's runs against 1 thread's row alone, token by token
    for i in range(0, len(runs), 3 * len(toks)):
        for j in range(3 * len(toks)):
            assert torch.equal(runs[i + j], runs[3 * (j // 3)]), f"run {i + j} differs from the row alone"


def test_lossy_pages_stay_near_the_reference_and_sinks_are_full_precision(model):
    ids = _ids(60, 4)
    with torch.inference_mode():
        ref = model(torch.tensor([ids])).logits[0].float()
        for spec, tol in (
            ("q8_0,residual=0", 0.05),
            ("q4_0,residual=0", 0.5),
            ("q8_0,residual=0,sink=32,residual_dtype=model", 1e-4),
            ("q4_0,residual_dtype=model", 1e-4),  # residual auto (128): 60 tokens, every one staged
            (
                "q4_0",
                5e-3,
            ),  # the same staged in float16 (residual_dtype auto, as a SlimCache keeps its residual)
        ):
            pool = pool_for(model, spec, pages=4, max_rows=1)
            row = pool.new_row()
            forward_pages(model, pool, [(ids[:40], row)])
            got = torch.stack([forward_pages(model, pool, [([t], row)])[0] for t in ids[40:]])
            err = (got - ref[40:]).abs().max().item()
            # sink=32: the sink page and the partly filled page are staged, so every key is read at full precision
            assert err < tol, (spec, err)
            if spec == "q4_0,residual=0":
                assert err > 1e-3  # the codes are read: the error is not zero


def test_a_step_the_pool_cannot_hold_changes_nothing(model):
    pool = pool_for(model, "q4_0", pages=3, max_rows=2)
    a, b = pool.new_row(), pool.new_row()
    with torch.inference_mode():
        forward_pages(model, pool, [(_ids(40, 5), a)])  # 2 pages
        before = (list(a.pages), a.length, pool.free_pages)
        with pytest.raises(ValueError, match=r"1 free pages of 3, this step needs 2 more"):
            forward_pages(model, pool, [([7], a), (_ids(33, 6), b)])
        assert (list(a.pages), a.length, pool.free_pages) == before and b.pages == [] and b.length == 0
        forward_pages(model, pool, [([7], a)])  # what fits still runs
    assert a.length == 41
    pool.free(a)
    assert pool.free_pages == 3 and pool.rows_alive == 1


@pytest.mark.parametrize("spec", ["q4_0", "q4_0,residual=32,sink=32"])
def test_a_failed_forward_leaves_the_rows_as_they_were(model, spec):
    """The failing step feeds a 70-token chunk (pages taken, residual pages left, pages started); the retry feeds
    one token: the row gets what a row fed only that token gets, and the pool its pages back."""
    ids = _ids(45, 7)
    with torch.inference_mode():
        pool = pool_for(model, spec, pages=8, max_rows=1)
        row = pool.new_row()
        forward_pages(model, pool, [(ids[:40], row)])
        free, pages = pool.free_pages, list(row.pages)
        layer = model.model.layers[1]

        def boom(*args, **kwargs):
            raise RuntimeError("injected")

        handle = layer.register_forward_pre_hook(boom)
        try:
            with pytest.raises(RuntimeError, match="injected"):
                forward_pages(model, pool, [(_ids(70, 8), row)])
        finally:
            handle.remove()
        assert (row.length, row.pages, pool.free_pages) == (40, pages, free)
        got = [forward_pages(model, pool, [([t], row)])[0] for t in ids[40:]]
        want = _alone(model, spec, ids[:40], ids[40:])
    assert all(torch.equal(x, y) for x, y in zip(got, want, strict=True))


def test_a_plan_that_fails_midway_takes_nothing(model, monkeypatch):
    pool = pool_for(model, "q4_0,residual=32", pages=8, max_rows=1)
    row = pool.new_row()
    with torch.inference_mode():
        forward_pages(model, pool, [(_ids(70, 12), row)])
        state = (
            list(row.pages),
            row.length,
            pool.free_pages,
            pool.stager.map.clone(),
            pool.stager.free_slots,
        )

        def boom(*args, **kwargs):
            raise RuntimeError("injected")

        monkeypatch.setattr(pool.stager, "plan", boom)
        with pytest.raises(RuntimeError, match="injected"):
            forward_pages(model, pool, [(_ids(40, 13), row)])
        monkeypatch.undo()
        assert (list(row.pages), row.length, pool.free_pages) == state[:3]
        assert torch.equal(pool.stager.map, state[3]) and pool.stager.free_slots == state[4]
        plan = pool.plan([row], [1])
        pool.abandon(plan)
        with pytest.raises(ValueError, match="committed or abandoned already"):
            pool.commit(plan)
        assert plan.abandoned and row.length == 70


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("int4,sink=4,window=200", r"window=200 in kvslim pages keeps every key at its original position: add "
         r"positions=original"),
        ("int4,window=200,positions=original", r"window=200 in kvslim pages needs its sinks named: add sink=N"),
        ("int4,sink=4,window=100,positions=original", r"window=100 in kvslim pages must hold the full-precision "
         r"residual and a page more \(128 \+ 32 tokens\)"),
        ("int4,positions=original", r"positions='original' is not supported in kvslim pages without a window"),
        ("int2", r"K format 'int2' needs KIVI's per-channel K groups"),
        ("int4,residual=48,group=16", r"residual=48 in kvslim pages must be a multiple of 32"),
        ("int4,keep_layers=0", r"keep_layers=\(0,\) is not supported in kvslim pages"),
        ("int4,pre_rope=1", r"pre_rope=1 is not supported in kvslim pages: their keys are stored after RoPE"),
    ],
)
def test_what_pages_cannot_store_is_refused_in_one_line(spec, match):
    with pytest.raises(ValueError, match=match) as e:
        check_config(kvslim.parse_spec(spec))
    assert "\n" not in str(e.value) and not str(e.value).startswith("kvslim:")


def test_copy_row_copies_codes_and_staged_pages(model):
    ids = _ids(64, 9)
    with torch.inference_mode():
        pool = pool_for(model, "q4_0", pages=12, max_rows=3)
        src = pool.new_row()
        forward_pages(model, pool, [(ids, src)])
        twin = pool.copy_row(src)
        assert twin.length == 64 and set(twin.pages).isdisjoint(src.pages)
        a, b = forward_pages(model, pool, [([5], src), ([5], twin)])
        assert torch.equal(a, b)
        forward_pages(model, pool, [([7], src)])  # 66 tokens: a partly filled page, staged
        third = pool.copy_row(src)
        a, b = forward_pages(model, pool, [([8], src), ([8], third)])
        assert torch.equal(a, b)
        pool.free(third)
        assert pool.rows_alive == 2
        # a freed row's staged page whose id the next copy takes: read from the copied codes, not the old tokens
        pool.free(twin)
        other = pool.new_row()
        forward_pages(model, pool, [(_ids(40, 11), other)])  # its second page is staged, partly filled
        staged = other.pages[1]
        pool.free(other)
        while src.length % 32:
            forward_pages(model, pool, [([6], src)])
        copy = pool.copy_row(src)
        assert staged in copy.pages
        a, b = forward_pages(model, pool, [([9], src), ([9], copy)])
        assert torch.equal(a, b)


def test_a_value_beyond_float16_is_refused_where_it_would_be_staged():
    pool = PagePool("q8_0", n_layers=1, kv_heads=1, head_dim=32, dtype=torch.float32, pages=2, max_rows=1)
    assert pool.stage_dtype == torch.float16
    row = pool.new_row()
    with torch.inference_mode():
        plan = pool.plan([row], [1])
        q, k = torch.randn(1, 1, 32), torch.randn(1, 1, 32)
        with pytest.raises(ValueError, match="not finite in float16 .* residual_dtype=model"):
            pool.attend(plan, 0, q, k * 1e6, k, 0.1)
        assert pool.basis.v is not None  # V is staged rotated: the edge is put where the rotation takes it
        for at, ok in ((-65510.0, True), (65530.0, False), (float("nan"), False)):  # from 65520 on: inf
            edge = torch.zeros(1, 1, 32)
            edge[0, 0, 3] = at
            v = pool.basis.v.apply(edge)  # H is its own inverse: v rotates back to edge
            if ok:  # rounds to float16's largest, -65504: staged
                pool.attend(plan, 0, q, k, v, 0.1)
                continue
            with pytest.raises(ValueError, match="a value value is not finite in float16"):
                pool.attend(plan, 0, q, k, v, 0.1)
        wide = PagePool("q8_0,residual_dtype=model", n_layers=1, kv_heads=1, head_dim=32, dtype=torch.float32,
                        pages=2, max_rows=1)  # fmt: skip
        wrow = wide.new_row()
        out = wide.attend(wide.plan([wrow], [1]), 0, q, k * 1e6, k, 0.1)
    assert torch.isfinite(out).all() and wide.stage_dtype == torch.float32


def test_rows_are_checked(model):
    pool = pool_for(model, "q8_0", pages=4, max_rows=1)
    row = pool.new_row()
    with pytest.raises(ValueError, match="at most 1 rows at once"):
        pool.new_row()
    other = pool_for(model, "q8_0", pages=4, max_rows=1).new_row()
    with torch.inference_mode():
        with pytest.raises(ValueError, match="each row at most once"):
            forward_pages(model, pool, [([5], row), ([6], row)])
        with pytest.raises(ValueError, match="live rows of its pool"):
            forward_pages(model, pool, [([5], other)])
        with pytest.raises(ValueError, match="has no tokens"):
            forward_pages(model, pool, [([], row)])
    pool.free(row)
    with pytest.raises(ValueError, match="not a live row"):
        pool.free(row)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="pages must be a positive integer"):
            PagePool("q8_0", n_layers=2, kv_heads=2, head_dim=32, dtype=torch.float32, pages=bad, max_rows=1)


def test_sliding_window_layers_are_refused():
    m = kvslim.enable(family_model("mistral_sliding"))
    pool = pool_for(m, "q8_0", pages=4, max_rows=1)
    row = pool.new_row()
    with torch.inference_mode(), pytest.raises(ValueError, match="a paged step serves plain attention only"):
        forward_pages(m, pool, [(_ids(5, 8), row)])
    assert row.length == 0


@pytest.mark.slow
def test_the_bench_script_runs_on_the_embedded_model(tmp_path):
    out = tmp_path / "paged.json"
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--rows", "2", "--length", "64", "--config", "q4_0", "--steps", "2",
         "--warmup", "1", "--chunk", "32", "--json", str(out)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    assert "q4_0" in run.stdout and "speed-up" in run.stdout
    import json

    got = json.loads(out.read_text())
    assert len(got["ms"]["q4_0"]["pages"]) == 2 and len(got["ms"]["q4_0"]["slimcache"]) == 2


@pytest.mark.parametrize(("spec", "window", "sink"), [("none", 50, 4), ("q8_0,residual=0", 50, 4), ("none", 40, 36)])
def test_a_window_in_pages_is_streamingllm_at_original_positions(model, spec, window, sink):
    """``sink=N,window=W,positions=original``: each step's logits are the plain forward's over the tokens a query
    sees (its first ``sink`` and its last ``window``, every key at its original position: a 4-D mask); the pages that
    left every later query's window went back to the pool, and the row holds at most its sink pages, its window and
    a page; the same bits as a SlimCache window at original positions would be read from other kernels, so the
    reference here is the masked forward."""
    cfg = f"{spec},sink={sink},window={window},positions=original"
    ids = _ids(150, 21)
    n = len(ids)
    pos = torch.arange(n)
    seen = (pos[None, :] <= pos[:, None]) & ((pos[None, :] > pos[:, None] - window) | (pos[None, :] < sink))
    mask = torch.zeros(1, 1, n, n).masked_fill(~seen, float("-inf"))
    with torch.inference_mode():
        plain = kvslim.enable(tiny_model("llama"))
        plain.set_attn_implementation("sdpa")
        ref = plain(torch.tensor([ids]), attention_mask=mask).logits[0].float()
        pool = pool_for(model, cfg, pages=12, max_rows=2)
        row = pool.new_row()
        got = [forward_pages(model, pool, [(ids[:70], row)])[0]]  # a prompt chunk past its window
        for t in ids[70:]:
            got.append(forward_pages(model, pool, [([t], row)])[0])
            live = sum(p >= 0 for p in row.pages)
            assert live <= -(-sink // 32) + -(-(window + 1) // 32) + 1
            assert pool.free_pages == pool.n_pages - live and pool.nbytes(row) == live * pool.page_bytes()
    tol = 1e-4 if spec == "none" else 0.05
    torch.testing.assert_close(torch.stack(got), torch.cat([ref[69:70], ref[70:]]), atol=tol, rtol=tol)
    assert row.gone > 0 and -1 in row.pages
    twin = pool.copy_row(row) if pool.free_pages >= sum(p >= 0 for p in row.pages) else None
    if twin is not None:
        assert [p < 0 for p in twin.pages] == [p < 0 for p in row.pages]
        with torch.inference_mode():
            a, b = forward_pages(model, pool, [([5], row), ([5], twin)])
        assert torch.equal(a, b)
        pool.free(twin)
    pool.free(row)
    assert pool.free_pages == pool.n_pages
