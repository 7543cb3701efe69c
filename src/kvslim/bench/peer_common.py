"""What the peer runners of ``kvslim bench --concurrency`` share (:mod:`.peer_openvino`, :mod:`.peer_vllm`).

The runners execute in the peers' own virtual environments as scripts, so this module imports nothing but
the standard library (and nothing of kvslim); a runner imports it as its sibling. A row is a dict of
:class:`kvslim.bench.concurrency.ConcurrencyRow` fields; a run that fails is a row with an ``error``.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from collections.abc import Callable


def pct(xs, q):
    """The ``q``-th percentile of ``xs`` (linear between the nearest ranks)."""
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def new_tokens(job: dict, run: dict) -> int:
    """Tokens each request generates: the timed window (``warmup + steps``, one more for the first token) and
    ``concurrency + 2`` more. The peers schedule a prompt per step at most (their token budget is set to one
    prompt, :func:`step_budget`), so the last request's first token comes up to ``concurrency`` steps after the
    first's; without the margin the first requests would finish before every stream decodes (a run of 16
    streams at 4,096 tokens had no step with all 16 decoding)."""
    return job["warmup"] + job["steps"] + 1 + run["concurrency"] + 2


def step_budget(run: dict) -> int:
    """The peers' tokens per step: one whole prompt (with its decode neighbours), so a prompt prefills in one
    step as kvslim's engine rows are prefilled before the timed window."""
    return run["length"] + run["concurrency"] + 8


def kv_elements_per_token(model_dir: str) -> int:
    """K and V elements a token holds over every layer of the model in ``model_dir`` (its config.json)."""
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * heads * head_dim


def step_row(peer: str, run: dict, warmup: int, decode: list[float], first_all: float | None, note: str) -> dict:
    """The row of one run from its decode step times (seconds; the first ``warmup`` not counted) and the time at
    which every request had its first token."""
    c = run["concurrency"]
    timed = decode[warmup:]
    row = {"mode": f"{peer} {run['spec']}", "kind": "peer", "length": run["length"], "concurrency": c,
           "steps": len(timed), "ms_median": float("nan"), "ms_q1": float("nan"), "ms_q3": float("nan"),
           "aggregate_tok_s": 0.0, "ratio_to_dynamic": None, "bytes_per_stream": None, "cache_bytes": None,
           "note": note + (f"; every prefill done at {first_all:.1f} s" if first_all is not None else "")}
    if not timed:
        row["note"] += "; no decode step with every stream running (raise --steps)"
        return row
    med = statistics.median(timed)
    row.update(ms_median=med * 1e3, ms_q1=pct(timed, 25) * 1e3, ms_q3=pct(timed, 75) * 1e3,
               aggregate_tok_s=c / med, itl_p50_ms=med * 1e3, itl_p90_ms=pct(timed, 90) * 1e3,
               itl_p99_ms=pct(timed, 99) * 1e3)
    return row


def error_row(peer: str, run: dict, why: str) -> dict:
    return {"mode": f"{peer} {run['spec']}", "kind": "peer", "length": run["length"],
            "concurrency": run["concurrency"], "error": why}


def guarded(peer: str, run: dict, fn: Callable[[], dict]) -> dict:
    """``fn()``'s row, or the error row of a run that does not go (a note in its row, never the whole job)."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - one run that does not go is a note in its row
        return error_row(peer, run, f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")


def emit(row: dict) -> dict:
    """Print the row to stderr (the progress of a long job) and return it."""
    print(json.dumps(row), file=sys.stderr, flush=True)
    return row


def write_rows(path: str, rows: list[dict]) -> None:
    """The rows as JSON at ``path`` (a temporary beside it, renamed)."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(rows, f)
    os.replace(tmp, path)
