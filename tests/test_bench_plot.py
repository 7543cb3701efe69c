"""kvslim.bench.plot: the decode time / memory picture from a bench result or its JSON."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("matplotlib")

from kvslim.bench.plot import plot_bench  # noqa: E402

PNG = b"\x89PNG\r\n\x1a\n"


def _row(mode, kind, length, ms, mib):
    return dict(
        mode=mode,
        kind=kind,
        length=length,
        ms_median=ms,
        ms_q1=0.9 * ms,
        ms_q3=1.1 * ms,
        cache_bytes=int(mib * 2**20),
    )


def _result():
    rows = []
    for n in (512, 2048, 4096):
        rows.append(_row("dynamic", "dynamic", n, 10 + n / 400, n / 40))
        rows.append(_row("int4", "kvslim", n, 10 + n / 900, n / 200))
        rows.append(_row("none,sink=4,window=1020", "kvslim", n, 10 + min(n, 1024) / 400, min(n, 1024) / 40))
        rows.append(_row("quanto-int4", "peer", n, 10 + n / 100, n / 180))
    return dict(settings=dict(attn="kvslim"), model=dict(name="tiny"), decode=rows)


def test_plot_from_a_result_dict_and_from_its_json(tmp_path):
    out = tmp_path / "bench.png"
    plot_bench(_result(), out)
    assert out.read_bytes()[:8] == PNG and out.stat().st_size > 10_000
    saved = tmp_path / "bench.json"
    saved.write_text(json.dumps(_result()))
    again = tmp_path / "again.png"
    plot_bench(str(saved), again, title="from JSON")
    assert again.read_bytes()[:8] == PNG


def test_a_result_without_decode_rows_is_refused(tmp_path):
    with pytest.raises(ValueError, match="no decode rows"):
        plot_bench(dict(decode=[]), tmp_path / "x.png")
