"""``kvslim bench --concurrency --peers --peer-rounds N`` (kvslim.bench.rounds): kvslim's rows and the serving peers
measured in turn, each row its median round, the peer/kvslim ratio per round. The peers' own processes are
replaced by a stand-in here (their venvs are not part of the test environment); timings are never asserted."""

from __future__ import annotations

import json
import math

import pytest

from conftest import save_tiny_word_model
from kvslim.bench.concurrency import ConcurrencyRow
from kvslim.bench.rounds import merge_rounds, render_round_ratios, round_ratios


def _row(mode: str, ms: float, kind: str = "pages", length: int = 16, c: int = 2, ratio=None) -> ConcurrencyRow:
    return ConcurrencyRow(mode=mode, kind=kind, length=length, concurrency=c, steps=4, ms_median=ms, ms_q1=ms,
                          ms_q3=ms, aggregate_tok_s=c / ms * 1e3 if ms == ms else 0.0, ratio_to_dynamic=ratio,
                          bytes_per_stream=None, cache_bytes=None)  # fmt: skip


def test_merge_keeps_one_round_as_it_is():
    rows = [_row("dynamic", 10.0, kind="dynamic", ratio=1.0), _row("int4+pages", 5.0, ratio=2.0)]
    assert merge_rounds([rows]) == rows and rows[1].rounds_ms is None


def test_merge_takes_each_rows_median_round():
    rounds = [[_row("int4+pages", 7.0, ratio=1.5), _row("int4+pages", 7.0, c=16)],
              [_row("int4+pages", 5.0), _row("int4+pages", float("nan"), c=16)],
              [_row("int4+pages", 9.0), _row("int4+pages", 3.0, c=16)],
              [_row("int4+pages", 6.0)]]  # fmt: skip
    merged = merge_rounds(rounds)
    assert [(r.mode, r.concurrency) for r in merged] == [("int4+pages", 2), ("int4+pages", 16)]
    two, sixteen = merged
    assert two.ms_median == 6.0 and two.rounds_ms == [7.0, 5.0, 9.0, 6.0]  # the lower middle of 5, 6, 7, 9
    assert two.ratio_to_dynamic is None  # link_ratios fills it from the merged dynamic row
    assert sixteen.ms_median == 3.0 and sixteen.rounds_ms == [7.0, None, 3.0]  # a failed round: None, not picked
    assert rounds[0][0].rounds_ms is None and rounds[0][0].ratio_to_dynamic == 1.5  # the rounds' rows untouched
    only_first = merge_rounds([[_row("continuous-batching", 8.0, kind="transformers", ratio=0.5)], []])
    assert only_first[0].ms_median == 8.0 and only_first[0].ratio_to_dynamic is None


def test_round_ratios_pair_each_peer_row_with_each_kvslim_row_round_by_round():
    ours = [[_row("dynamic", 40.0, kind="dynamic"), _row("int4+pages", 10.0), _row("int4", 20.0, kind="kvslim"),
             _row("int4+pages", 10.0, c=16)],
            [_row("dynamic", 40.0, kind="dynamic"), _row("int4+pages", 8.0), _row("int4", float("nan"), kind="kvslim"),
             _row("int4+pages", 10.0, c=16)]]  # fmt: skip
    theirs = [[_row("openvino int4", 12.0, kind="openvino")], [_row("openvino int4", 12.0, kind="openvino")]]
    got = {(r["peer"], r["kvslim"], r["concurrency"]): r for r in round_ratios(ours, theirs)}
    assert set(got) == {("openvino int4", "int4+pages", 2), ("openvino int4", "int4", 2)}  # not dynamic, not C=16
    pages = got[("openvino int4", "int4+pages", 2)]
    assert pages["rounds"] == [1.2, 1.5] and math.isclose(pages["median"], 1.35) and pages["length"] == 16
    assert got[("openvino int4", "int4", 2)]["rounds"] == [0.6]  # the failed round left out
    text = render_round_ratios(round_ratios(ours, theirs), 2)
    assert "openvino int4 / int4+pages" in text and "1.200 1.500   median 1.350" in text
    with pytest.raises(ValueError, match="2 rounds of kvslim's rows but 1 of the peers'"):
        round_ratios(ours, theirs[:1])


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--concurrency", "2", "--peer-rounds", "0"], "--peer-rounds must be an integer >= 1, got 0"),
        (["--concurrency", "2", "--peer-rounds", "3"], "--peer-rounds 3 alternates --concurrency's rows with its"),
        (["--peers", "--peer-rounds", "2"], "--peer-rounds 2 alternates --concurrency's rows with its serving peers"),
    ],
)
def test_bad_peer_rounds_are_one_line(tmp_path, capsys, argv, message):
    from kvslim.cli import main

    model = save_tiny_word_model(tmp_path)
    capsys.readouterr()  # (the model's save)
    assert main(["bench", "--model", str(model), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_cli_alternates_kvslim_and_the_peers(tmp_path, capsys, monkeypatch):
    from kvslim.bench import concurrency, concurrency_peers
    from kvslim.cli import main

    calls: list[str] = []
    prefills: list[str] = []
    real_prefilled = concurrency.prefilled

    def counting_prefilled(model, modes, length, **kw):
        prefills.append(str(length))
        return real_prefilled(model, modes, length, **kw)

    real_measure = concurrency.measure_concurrency

    def measure(*a, **kw):
        calls.append("kvslim")
        return real_measure(*a, **kw)

    def peers(names, model, specs, prompt, lengths, concurrencies, steps, **kw):
        calls.append("peers")
        ms = 100.0 * len([c for c in calls if c == "peers"])  # 100 ms, then 200 ms
        rows = [_row(f"openvino {s}", ms, kind="openvino", length=n, c=c) for s in specs for n in lengths
                for c in concurrencies]  # fmt: skip
        return rows, {"openvino": "peer openvino: a stand-in, 1 rows"}

    monkeypatch.setattr(concurrency, "prefilled", counting_prefilled)
    monkeypatch.setattr(concurrency, "measure_concurrency", measure)
    monkeypatch.setattr(concurrency_peers, "run_peers", peers)
    out_json = tmp_path / "rounds.json"
    code = main(["bench", "--model", str(save_tiny_word_model(tmp_path)), "--concurrency", "2", "--lengths", "16",
                 "--config", "int4", "--pages", "--steps", "2", "--warmup", "0", "--no-continuous-batching",
                 "--peers", "openvino", "--peer-rounds", "2", "--json", str(out_json), "--quiet"])  # fmt: skip
    text = capsys.readouterr().out
    assert code == 0, text
    assert calls == ["kvslim", "peers", "kvslim", "peers"] and prefills == ["16"]  # prefilled once for both rounds
    data = json.loads(out_json.read_text())
    assert data["settings"]["peer_rounds"] == 2
    rows = {r["mode"]: r for r in data["concurrency"]}
    assert set(rows) == {"dynamic", "int4", "int4+pages", "openvino int4"}
    assert rows["openvino int4"]["rounds_ms"] == [100.0, 200.0] and rows["openvino int4"]["ms_median"] == 100.0
    assert len(rows["int4+pages"]["rounds_ms"]) == 2 and rows["int4+pages"]["ms_median"] in rows["int4+pages"]["rounds_ms"]
    assert rows["int4"]["ratio_to_dynamic"] is not None  # linked to the merged dynamic row
    pairs = {(r["peer"], r["kvslim"]): r for r in data["peer_rounds"]}
    assert set(pairs) == {("openvino int4", "int4"), ("openvino int4", "int4+pages")}
    assert all(len(r["rounds"]) == 2 and r["median"] is not None for r in pairs.values())
    assert "peer step / kvslim step in each of 2 rounds" in text and "openvino int4 / int4+pages" in text
