"""Load test for ``kvslim serve``: N concurrent multi-turn chat sessions against a server this script starts.

The script starts ``kvslim serve`` itself (127.0.0.1, a free port, a ``--session-dir`` in a temporary
directory, the model and cache flags given here), waits for ``GET /health``, then runs ``--sessions``
conversations at once, each ``--turns`` turns long: a streamed chat completion at temperature 0 with the
``session`` field, so each turn continues the conversation's kept cache; the assistant's reply and a short
new user message are appended for the next turn. It records, per request, the time to first token, the
gaps between streamed chunks, the usage (prompt and cached tokens) and the outcome:

- answered: the stream ended with ``data: [DONE]`` after a finish_reason;
- refused: an HTTP error status with OpenAI's error body (the reason is kept), or an error event in the stream;
- lost: anything else (a connection error, a timeout, a stream cut short). The exit status is 1 if any was lost.

The server's RSS (``VmRSS`` of ``/proc/<pid>/status``) is sampled every 0.5 s; ``/metrics`` is read at the
end; the server is stopped with SIGTERM and must exit. Everything talks to 127.0.0.1 only; the turns are
bounded in count (``--turns``) and in time (``--time-limit``: no turn starts after it, and a request gives
up after ``--request-timeout``), so the script always stops by itself.

Optional, after the load phase: ``--greedy-check`` sends one prompt at temperature 0 through the server
(no session) and through ``kvslim sample --temperature 0`` with the same flags, both as chat
(``sample --chat`` vs ``/v1/chat/completions``) and as plain text (``sample`` vs ``/v1/completions``), and
compares the texts; ``--restart-check`` runs one session for a turn, stops the server with SIGTERM (it parks
the session in ``--session-dir``), starts a new server on the same directory and continues the session,
which must report cached tokens > 0.

    python scripts/load_test.py --sessions 16 --turns 20 --max-tokens 32 --time-limit 690 \\
        --greedy-check --restart-check --json docs/img/serving-load.json --plot docs/img/serving-load.png \\
        -- --kv-quantize int4 --streaming-llm-sink 4 --streaming-llm-window 1020

Flags after ``--`` are model and cache flags, given to ``kvslim serve`` and to ``kvslim sample``;
``--serve-args`` adds flags for the server only; ``--memory-budget SIZE`` and ``--api-key KEY`` are passed to
every server this script starts (the clients then send the key). ``--stagger S`` starts conversation i at
i x S seconds instead of all at once. See docs/serving.md.

Issue 29's measurements:

- ``--long-prompt TOKENS``: the load phase runs twice, with the same conversations under new session ids:
  once as above (the baseline), then again with one extra client that sends a prompt of about TOKENS tokens
  (the texts of /usr/share/common-licenses, repeated: real English) to ``/v1/completions``, streamed, at
  ``--long-prompt-delay`` seconds into the phase, through the server's cache (a windowed one, from the flags
  after ``--``, or ``--long-prompt-cache SPEC`` sent as ``kvslim_cache``). Its prefill lasts until its first
  token; a request of the other conversations *overlaps* it when it was waiting for its own first token
  during that time. The report compares the time to first token (p50/p90/p99) of the baseline, of the
  second phase, and of the requests that overlapped the long prefill (and of the baseline's requests of
  the same turns).
- ``--attack``: before the load phase (``--sessions 0``: instead of it), replays issue 29's bad requests
  against the started server, one at a time, and prints a table: the request, its status (and the one
  expected), whether the server still answers ``/health`` 200 and a normal request at temperature 0 with the
  text it gave before, its RSS after and its peak RSS during the request (``VmHWM``, reset through
  ``/proc/PID/clear_refs``). The last row is a flood of ``--attack-sessions`` distinct session ids (one
  token in, one out each), after which the files in the session directory and the sessions the server
  reports are listed too.

    python scripts/load_test.py --sessions 15 --turns 8 --stagger 0.5 --long-prompt 50000 \\
        --long-prompt-delay 30 -- --kv-quantize int4 --streaming-llm-sink 4 --streaming-llm-window 1020
    python scripts/load_test.py --sessions 0 --attack --attack-sessions 10000 --memory-budget 256MiB
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

# the server process, the streaming client and the percentiles are the library's (kvslim bench --serve uses them)
from kvslim.bench.server import MODEL, Server, free_port, pct, read_metrics, stream_request  # noqa: F401

OPENERS = (
    "Name a color and say one thing about it.",
    "What is a good name for a cat?",
    "Tell me a fact about the moon.",
    "Suggest a breakfast.",
    "What is the capital of France?",
    "Give me a word that rhymes with tree.",
    "Describe the sea in one sentence.",
    "What is two plus two?",
)
# follow-ups long enough (~30 tokens) that a 20-turn conversation outgrows a 1024-token window
FOLLOW_UPS = (
    "Tell me more about that, with one detail I have not heard yet, and keep it short and simple please.",
    "Why is that so? Explain it as you would to a child who asks a lot of questions, in a few words.",
    "Give me one example of that from everyday life, something a person might see on a normal day.",
    "Say the same thing differently, as if you were writing a short note to a friend who is far away.",
    "And what happens after that? Continue the story a little, but do not repeat what you already said.",
    "Go on, but this time add a number or a date somewhere in your answer so that it is more precise.",
)


# -- one request ---------------------------------------------------------------------------


async def chat_turn(
    client: httpx.AsyncClient,
    messages: list[dict],
    *,
    session: str | None,
    max_tokens: int,
    timeout: float,
    t_origin: float,
    model: str = MODEL,
) -> dict:
    """One streamed chat completion at temperature 0; the record of what happened (never raises)."""
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if session is not None:
        body["session"] = session
    return await stream_request(client, "/v1/chat/completions", body, timeout=timeout, t_origin=t_origin)


# -- the load phase ------------------------------------------------------------------------


async def conversation(
    client, sid: int, args, deadline: float, t_origin: float, records: list, *, model: str = MODEL, prefix="load"
) -> None:
    await asyncio.sleep(sid * args.stagger)  # staggered arrivals (--stagger; 0: all at once)
    messages = [{"role": "user", "content": OPENERS[sid % len(OPENERS)]}]
    for turn in range(1, args.turns + 1):
        if time.monotonic() > deadline:
            return  # bounded in time: no new turn starts (counted as not run, not as lost)
        rec = await chat_turn(
            client,
            messages,
            session=f"{prefix}-{sid}",
            max_tokens=args.max_tokens,
            timeout=args.request_timeout,
            t_origin=t_origin,
            model=model,
        )
        rec.update(session=sid, turn=turn)
        records.append(rec)
        if rec["outcome"] != "answered":
            return  # the conversation cannot go on without its reply
        messages += [
            {"role": "assistant", "content": rec["text"]},
            {"role": "user", "content": FOLLOW_UPS[(sid + turn) % len(FOLLOW_UPS)]},
        ]


async def load_phase(server: Server, args, *, prefix: str = "load", long_prompt: str | None = None) -> dict:
    """The conversations (session ids ``{prefix}-{i}``), the server's RSS every 0.5 s and, with
    ``long_prompt``, one more client sending it at ``--long-prompt-delay`` s (its record: ``"long"``)."""
    records: list[dict] = []
    long: dict = {}
    rss: list[tuple[float, int]] = []
    t_origin = time.perf_counter()
    deadline = time.monotonic() + args.time_limit
    stop = asyncio.Event()

    async def sample_rss():
        while not stop.is_set():
            value = server.rss()
            if value is not None:
                rss.append((round(time.perf_counter() - t_origin, 3), value))
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.5)

    async def long_client(client):
        await asyncio.sleep(args.long_prompt_delay)
        body = {"model": server.model, "prompt": long_prompt, "max_tokens": args.long_prompt_max_tokens,
                "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
        if args.long_prompt_cache:
            body["kvslim_cache"] = args.long_prompt_cache
        long.update(await stream_request(client, "/v1/completions", body, timeout=args.long_prompt_timeout,
                                         t_origin=t_origin))

    limits = httpx.Limits(max_connections=args.sessions + 4, max_keepalive_connections=args.sessions + 4)
    sampler = asyncio.create_task(sample_rss())
    async with httpx.AsyncClient(base_url=server.url, limits=limits, timeout=None, headers=server.headers) as client:
        tasks = [
            conversation(client, i, args, deadline, t_origin, records, model=server.model, prefix=prefix)
            for i in range(args.sessions)
        ]
        if long_prompt is not None:
            tasks.append(long_client(client))
        await asyncio.gather(*tasks)
    wall = time.perf_counter() - t_origin
    stop.set()
    await sampler
    return {"records": records, "rss": rss, "wall_s": wall, "long": long or None}


# -- statistics ----------------------------------------------------------------------------


def rss_at(rss: list[tuple[float, int]], t: float) -> int | None:
    """The first RSS sample at or after time t (the last one if none)."""
    for when, value in rss:
        if when >= t:
            return value
    return rss[-1][1] if rss else None


def summarize(load: dict, args) -> dict:
    recs, rss, wall = load["records"], load["rss"], load["wall_s"]
    answered = [r for r in recs if r["outcome"] == "answered"]
    outcomes = {k: sum(r["outcome"] == k for r in recs) for k in ("answered", "refused", "lost")}
    reasons = sorted({f"{r['outcome']}: {r['reason']}" for r in recs if r["outcome"] != "answered"})
    itl = [x for r in answered for x in r["itl_s"]]
    ttft = [r["ttft_s"] for r in answered if r["ttft_s"] is not None]
    by_turn = []
    for turn in range(1, args.turns + 1):
        rs = [r for r in answered if r["turn"] == turn]
        if not rs:
            continue
        end = max(r["end_s"] for r in rs)
        t = [r["ttft_s"] for r in rs if r["ttft_s"] is not None]
        by_turn.append(
            {
                "turn": turn,
                "n": len(rs),
                "ttft_p50_s": pct(t, 50),
                "ttft_p90_s": pct(t, 90),
                "ttft_p99_s": pct(t, 99),
                "prompt_tokens_mean": _mean([r["prompt_tokens"] for r in rs]),
                "cached_tokens_mean": _mean([r["cached_tokens"] for r in rs]),
                "completion_tokens_mean": _mean([r["completion_tokens"] for r in rs]),
                "end_s": end,
                "rss_bytes": rss_at(rss, end),
            }
        )
    turns = {b["turn"]: b for b in by_turn}
    last = by_turn[-1] if by_turn else None
    tokens = sum(r["completion_tokens"] or 0 for r in answered)
    s = {
        "requests": len(recs),
        "planned": args.sessions * args.turns,
        **outcomes,
        "not_run_time_limit": args.sessions * args.turns
        - len(recs)
        - sum(args.turns - r["turn"] for r in recs if r["outcome"] != "answered"),
        "failure_reasons": reasons,
        "wall_s": wall,
        "requests_per_s": len(answered) / wall if wall else None,
        "completion_tokens": tokens,
        "completion_tokens_per_s": tokens / wall if wall else None,
        "ttft_p50_s": pct(ttft, 50),
        "ttft_p90_s": pct(ttft, 90),
        "ttft_p99_s": pct(ttft, 99),
        "itl_p50_s": pct(itl, 50),
        "itl_p90_s": pct(itl, 90),
        "itl_p99_s": pct(itl, 99),
        "rss_first_bytes": rss[0][1] if rss else None,
        "rss_peak_bytes": max((v for _, v in rss), default=None),
        "by_turn": by_turn,
    }
    if 5 in turns and last is not None:
        s["rss_turn5_bytes"], s["rss_last_bytes"], s["last_turn"] = (
            turns[5]["rss_bytes"],
            last["rss_bytes"],
            last["turn"],
        )
        s["rss_last_over_turn5"] = last["rss_bytes"] / turns[5]["rss_bytes"]
    if 2 in turns and last is not None:
        s["ttft_last_over_turn2_p50"] = last["ttft_p50_s"] / turns[2]["ttft_p50_s"]
    return s


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def _ms(x) -> str:
    return "n/a" if x is None else f"{1000 * x:.0f}"


def _mib(x) -> str:
    return "n/a" if x is None else f"{x / 2**20:.0f}"


def print_table(s: dict, metrics: dict) -> None:
    p = print
    p(
        f"\nrequests {s['requests']} of {s['planned']} planned | answered {s['answered']} | refused {s['refused']} | "
        f"lost {s['lost']} | not started (time limit) {s['not_run_time_limit']}"
    )
    for reason in s["failure_reasons"]:
        p(f"  {reason}")
    p(
        f"wall {s['wall_s']:.1f} s | {s['requests_per_s']:.2f} requests/s | {s['completion_tokens']} tokens, "
        f"{s['completion_tokens_per_s']:.1f} tokens/s"
    )
    p("\n| | p50 | p90 | p99 |\n|---|---:|---:|---:|")
    p(
        f"| time to first token (ms) | {_ms(s['ttft_p50_s'])} | {_ms(s['ttft_p90_s'])} | {_ms(s['ttft_p99_s'])} |"
    )
    p(f"| inter-token latency (ms) | {_ms(s['itl_p50_s'])} | {_ms(s['itl_p90_s'])} | {_ms(s['itl_p99_s'])} |")
    p(
        "\n| turn | answered | prompt tokens | cached tokens | completion tokens | TTFT p50 (ms) | p90 | p99 "
        "| server RSS (MiB) |"
    )
    p("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for b in s["by_turn"]:
        p(
            f"| {b['turn']} | {b['n']} | {b['prompt_tokens_mean'] or 0:.0f} | {b['cached_tokens_mean'] or 0:.0f} | "
            f"{b['completion_tokens_mean'] or 0:.1f} | {_ms(b['ttft_p50_s'])} | {_ms(b['ttft_p90_s'])} | {_ms(b['ttft_p99_s'])} | {_mib(b['rss_bytes'])} |"
        )
    if "rss_last_over_turn5" in s:
        p(
            f"\nserver RSS: turn 5 {_mib(s['rss_turn5_bytes'])} MiB, turn {s['last_turn']} {_mib(s['rss_last_bytes'])} MiB "
            f"({s['rss_last_over_turn5']:.3f}x; target <= 1.10) | peak {_mib(s['rss_peak_bytes'])} MiB"
        )
    if "ttft_last_over_turn2_p50" in s:
        p(f"TTFT p50: last turn / turn 2 = {s['ttft_last_over_turn2_p50']:.2f}x (target <= 1.5)")
    keys = [
        k
        for k in metrics
        if k.startswith(
            (
                "kvslim_requests_total",
                "kvslim_sessions_",
                "kvslim_cache_bytes",
                "kvslim_prefilled",
                "kvslim_cached_prompt",
                "kvslim_prompt_tokens",
            )
        )
    ]
    if keys:
        p("\n/metrics: " + ", ".join(f"{k.removeprefix('kvslim_')} {metrics[k]:g}" for k in keys))


def plot(load: dict, s: dict, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    ts = [t for t, _ in load["rss"]]
    a.plot(ts, [v / 2**20 for _, v in load["rss"]], lw=1.2, label="server RSS")
    a.set_ylim(0, 1.15 * max((v for _, v in load["rss"]), default=2**20) / 2**20)
    for bt in s["by_turn"]:
        if bt["turn"] in (1, 2, 5, 10, 15, 20) or bt is s["by_turn"][-1]:
            a.axvline(bt["end_s"], color="grey", lw=0.6, ls=":")
            a.text(bt["end_s"], a.get_ylim()[0], f" t{bt['turn']}", fontsize=7, va="bottom", color="grey")
    a.set_xlabel("time since the first request (s)")
    a.set_ylabel("RSS (MiB)")
    a.set_title("server RSS (dotted: turn t finished by every session)", fontsize=9)
    turns = [bt["turn"] for bt in s["by_turn"]]
    for key, label in (("ttft_p50_s", "p50"), ("ttft_p90_s", "p90"), ("ttft_p99_s", "p99")):
        b.plot(turns, [1000 * bt[key] for bt in s["by_turn"]], marker="o", ms=3, label=f"TTFT {label}")
    b.set_xlabel("turn")
    b.set_ylabel("time to first token (ms)")
    b.set_ylim(bottom=0)
    b2 = b.twinx()
    b2.plot(
        turns,
        [bt["prompt_tokens_mean"] for bt in s["by_turn"]],
        color="black",
        lw=0.8,
        ls="--",
        label="prompt tokens (mean)",
    )
    b2.set_ylabel("prompt tokens")
    b2.set_ylim(bottom=0)
    h1, l1 = b.get_legend_handles_labels()
    h2, l2 = b2.get_legend_handles_labels()
    b.legend(h1 + h2, l1 + l2, fontsize=7, loc="upper left")
    b.set_title("time to first token by turn", fontsize=9)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- the greedy and restart checks -----------------------------------------------------------


def greedy_check(server: Server, args, flags: list[str], tmp: str) -> list[dict]:
    """The same prompt through ``kvslim sample --temperature 0`` and through the server at temperature 0."""
    out = []
    for mode in ("chat", "text"):
        prompt = args.greedy_prompt if mode == "chat" else args.greedy_text_prompt
        report = os.path.join(tmp, f"sample-{mode}.json")
        cmd = [
            args.kvslim,
            "sample",
            "--prompt",
            prompt,
            "--temperature",
            "0",
            "--tokens",
            str(args.greedy_tokens),
            "--report-json",
            report,
            *flags,
        ]
        if mode == "chat":
            cmd.append("--chat")
        t0 = time.monotonic()
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=args.request_timeout + 120, stdin=subprocess.DEVNULL
        )
        if proc.returncode != 0:
            out.append(
                {
                    "mode": mode,
                    "identical": False,
                    "error": f"kvslim sample exited {proc.returncode}: {proc.stderr.strip()[-300:]}",
                }
            )
            continue
        sample_text = proc.stdout.removesuffix("\n")
        rep = json.loads(Path(report).read_text())
        sample_s = time.monotonic() - t0
        body = {"model": server.model, "max_tokens": args.greedy_tokens, "temperature": 0}
        if mode == "chat":
            body["messages"] = [{"role": "user", "content": prompt}]
            endpoint = "/v1/chat/completions"
        else:
            body["prompt"] = prompt
            endpoint = "/v1/completions"
        r = httpx.post(server.url + endpoint, json=body, timeout=args.request_timeout, headers=server.headers)
        r.raise_for_status()
        reply = r.json()
        choice = reply["choices"][0]
        server_text = choice["message"]["content"] if mode == "chat" else choice["text"]
        out.append(
            {
                "mode": mode,
                "prompt": prompt,
                "endpoint": endpoint,
                "sample_flags": shlex.join(cmd[1:]),
                "identical": sample_text == server_text,
                "prompt_tokens": {"sample": rep["prompt_tokens"], "server": reply["usage"]["prompt_tokens"]},
                "completion_tokens": {
                    "sample": rep["new_tokens"],
                    "server": reply["usage"]["completion_tokens"],
                },
                "finish_reason": choice["finish_reason"],
                "sample_s": round(sample_s, 1),
                "sample_text": sample_text,
                "server_text": server_text,
                "quantization_warning": "nothing will be quantized" in proc.stderr,
            }
        )
    return out


def restart_check(args, flags: list[str], tmp: str) -> dict:
    """One session: a turn, SIGTERM (the session is parked on disk), a new server on the same directory,
    the next turn continued from the parked cache."""
    session_dir = os.path.join(tmp, "sessions-restart")
    log = os.path.join(tmp, "serve-restart.log")
    messages = [{"role": "user", "content": "Name a color and say one thing about it."}]
    body = {"max_tokens": args.max_tokens, "temperature": 0, "session": "restart-1"}
    first = Server(args.kvslim, flags, session_dir, log, api_key=args.api_key)
    first.start()
    try:
        r1 = httpx.post(
            first.url + "/v1/chat/completions",
            json={**body, "model": first.model, "messages": messages},
            timeout=args.request_timeout,
            headers=first.headers,
        ).json()
    finally:
        stop1 = first.stop()
    files = sorted(os.listdir(session_dir)) if os.path.isdir(session_dir) else []
    sizes = [os.path.getsize(os.path.join(session_dir, f)) for f in files]
    if "choices" not in r1:
        return {"ok": False, "error": f"turn 1: {str(r1)[:300]}", "first_server_stop": stop1}
    messages += [
        {"role": "assistant", "content": r1["choices"][0]["message"]["content"]},
        {"role": "user", "content": "Why that one?"},
    ]
    second = Server(args.kvslim, flags, session_dir, log, api_key=args.api_key)
    second.start()
    try:
        r2 = httpx.post(
            second.url + "/v1/chat/completions",
            json={**body, "model": second.model, "messages": messages},
            timeout=args.request_timeout,
            headers=second.headers,
        ).json()
        metrics = read_metrics(second.url, second.headers)
    finally:
        stop2 = second.stop()
    if "usage" not in r1 or "usage" not in r2:
        return {"ok": False, "error": f"turn 1: {str(r1)[:300]}; turn 2: {str(r2)[:300]}",
                "first_server_stop": stop1, "second_server_stop": stop2}
    u1, u2 = r1["usage"], r2["usage"]
    cached = u2["prompt_tokens_details"]["cached_tokens"]
    return {
        "turn1": {
            "prompt_tokens": u1["prompt_tokens"],
            "cached_tokens": u1["prompt_tokens_details"]["cached_tokens"],
            "text": r1["choices"][0]["message"]["content"],
        },
        "first_server_stop": stop1,
        "parked_files": len(files),
        "parked_bytes": sum(sizes),
        "turn2": {
            "prompt_tokens": u2["prompt_tokens"],
            "cached_tokens": cached,
            "text": r2["choices"][0]["message"]["content"],
        },
        "sessions_restored_total": metrics.get("kvslim_sessions_restored_total"),
        "second_server_stop": stop2,
        "ok": cached > 0 and metrics.get("kvslim_sessions_restored_total", 0) >= 1,
    }


# -- the long prompt (--long-prompt) ----------------------------------------------------------

LICENSES = "/usr/share/common-licenses"


def english_text(min_chars: int) -> str:
    """The texts of /usr/share/common-licenses (each file once, symlinks skipped), repeated to at least
    ``min_chars`` characters: real English, as a long document a user pastes would be."""
    texts = []
    for name in sorted(os.listdir(LICENSES)):
        path = os.path.join(LICENSES, name)
        if os.path.isfile(path) and not os.path.islink(path):
            texts.append(Path(path).read_text(errors="replace"))
    if not texts:
        raise RuntimeError(f"no texts in {LICENSES}")
    one = "\n\n".join(texts)
    return (one + "\n\n") * (min_chars // (len(one) + 2) + 1)


def long_prompt_text(server: Server, tokens: int) -> tuple[str, float]:
    """About ``tokens`` tokens of English text for this server's tokenizer, and the characters per token
    measured on 8 pieces of 1,000 characters taken across the texts (one ``/v1/completions`` request of one
    token)."""
    one = english_text(1)
    step = max(1, (len(one) - 1000) // 8)
    sample = "".join(one[i * step : i * step + 1000] for i in range(8))
    r = httpx.post(server.url + "/v1/completions", headers=server.headers, timeout=600.0,
                   json={"model": server.model, "prompt": sample, "max_tokens": 1, "temperature": 0})
    r.raise_for_status()
    per_token = len(sample) / r.json()["usage"]["prompt_tokens"]
    chars = int(tokens * per_token)
    return english_text(chars)[:chars], per_token


def overlapped(rec: dict, long: dict) -> bool:
    """Whether ``rec`` waited for its first token while the long prompt was prefilling (from the long
    request's start to its first chunk)."""
    if rec.get("start_s") is None or long.get("start_s") is None or long.get("first_token_s") is None:
        return False  # the long prompt was refused or failed: nothing overlapped its prefill
    prefill_end = long["start_s"] + long["first_token_s"]
    first = rec["start_s"] + (rec["ttft_s"] if rec.get("ttft_s") is not None else 0.0)
    return rec["start_s"] < prefill_end and first > long["start_s"]


def ttft_row(recs: list[dict]) -> dict:
    t = [r["ttft_s"] for r in recs if r["outcome"] == "answered" and r["ttft_s"] is not None]
    return {"n": len(t), "p50_s": pct(t, 50), "p90_s": pct(t, 90), "p99_s": pct(t, 99)}


def compare_long(base: dict, loaded: dict, long: dict | None, tokens: int, per_token: float) -> dict:
    """The time to first token without the long prompt, with it, and of the requests its prefill overlapped."""
    long = long or {}
    over = [r for r in loaded["records"] if overlapped(r, long)]
    turns = {r["turn"] for r in over}
    rows = {
        "without (baseline phase)": ttft_row(base["records"]),
        "without, same turns as the overlapping": ttft_row([r for r in base["records"] if r["turn"] in turns]),
        "with (second phase, every request)": ttft_row(loaded["records"]),
        "with, overlapping its prefill": ttft_row(over),
    }
    b, o = rows["without (baseline phase)"]["p99_s"], rows["with, overlapping its prefill"]["p99_s"]
    return {
        "tokens_requested": tokens,
        "chars_per_token": per_token,
        "prompt_tokens": long.get("prompt_tokens"),
        "outcome": long.get("outcome"),
        "reason": long.get("reason"),
        "start_s": long.get("start_s"),
        "prefill_s": long.get("first_token_s"),
        "end_s": long.get("end_s"),
        "ttft": rows,
        "p99_overlap_over_baseline": o / b if o is not None and b else None,
    }


def print_long(c: dict) -> None:
    p = print
    p(
        f"\nlong prompt: {c['prompt_tokens']} tokens (asked {c['tokens_requested']}, {c['chars_per_token']:.2f} "
        f"characters per token) | outcome {c['outcome']}{' (' + c['reason'] + ')' if c['reason'] else ''} | "
        f"sent at {c['start_s'] or 0:.1f} s | prefill (its TTFT) {_ms(c['prefill_s'])} ms"
    )
    p("\n| other conversations' requests | n | TTFT p50 (ms) | p90 | p99 |\n|---|---:|---:|---:|---:|")
    for name, r in c["ttft"].items():
        p(f"| {name} | {r['n']} | {_ms(r['p50_s'])} | {_ms(r['p90_s'])} | {_ms(r['p99_s'])} |")
    ratio = c["p99_overlap_over_baseline"]
    p(f"TTFT p99 overlapping / baseline: {'n/a' if ratio is None else f'{ratio:.2f}x'} (target <= 2)")


# -- the attack table (--attack) ---------------------------------------------------------------


def _raw(body: bytes, ctype: str = "application/json", **headers) -> dict:
    return {"content": body, "headers": {"Content-Type": ctype, **headers}}


def attack_requests(server: Server, normal: dict) -> list[tuple[str, str, str, dict]]:
    """Issue 29's bad requests: (name, path, expected status, httpx request arguments)."""
    m = server.model
    one = {**normal, "max_tokens": 1}
    big = 64 << 20

    def chunked():  # a body with no Content-Length, past the 8 MiB limit
        yield b'{"model": "x", "prompt": "'
        piece = b" " * (1 << 20)
        for _ in range(big // len(piece)):
            yield piece
        yield b'"}'

    rows = [
        ("session \"\\ud800\" (a lone surrogate)", "/v1/completions", "400",
         _raw(b'{"model": "%s", "prompt": "hi", "max_tokens": 1, "session": "\\ud800"}' % m.encode())),
        ("X-Session-Id: invalid UTF-8 bytes", "/v1/completions", "400",
         {"json": one, "headers": {"X-Session-Id": b"\xed\xa0\x80"}}),
        ("session id of 100,000 characters", "/v1/completions", "400", {"json": {**one, "session": "s" * 100_000}}),
        ('kvslim_cache "none,group=1000000"', "/v1/completions", "400", {"json": {**one, "kvslim_cache": "none,group=1000000"}}),
        ('kvslim_cache "none,group=10000000"', "/v1/completions", "400",
         {"json": {**one, "kvslim_cache": "none,group=10000000"}}),
        ('kvslim_cache "int4,window=100000000"', "/v1/completions", "400",
         {"json": {**one, "kvslim_cache": "int4,window=100000000"}}),
        ("Content-Type: text/plain", "/v1/completions", "415", _raw(json.dumps(one).encode(), "text/plain")),
        ("Content-Type: application/x-www-form-urlencoded", "/v1/completions", "415",
         _raw(json.dumps(one).encode(), "application/x-www-form-urlencoded")),
        ("Host: evil.example (DNS rebinding)", "/v1/completions", "421",
         {"json": one, "headers": {"Host": f"evil.example:{server.port}"}}),
        ("tools (not honoured)", "/v1/chat/completions", "400",
         {"json": {"model": m, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                   "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}}),
        ('stop ["\\n"] (honoured)', "/v1/completions", "200", {"json": {**one, "max_tokens": 4, "stop": ["\n"]}}),
        ("chunked body of 64 MiB", "/v1/completions", "413", {"content": chunked(),
                                                              "headers": {"Content-Type": "application/json"}}),
        ("10,000 nested lists", "/v1/completions", "400", _raw(b"[" * 10_000 + b"]" * 10_000)),
        ("max_tokens of 5,000 digits", "/v1/completions", "400",
         _raw(b'{"model": "%s", "prompt": "hi", "max_tokens": %s}' % (m.encode(), b"9" * 5000))),
        ("temperature of 401 digits (past a float)", "/v1/completions", "400",
         _raw(b'{"model": "%s", "prompt": "hi", "max_tokens": 1, "temperature": 1%s}' % (m.encode(), b"0" * 400))),
        ("temperature NaN", "/v1/completions", "400",
         _raw(b'{"model": "%s", "prompt": "hi", "max_tokens": 1, "temperature": NaN}' % m.encode())),
        ("max_tokens 10**9", "/v1/completions", "400", {"json": {**one, "max_tokens": 10**9}}),
        ("body not UTF-8", "/v1/completions", "400", _raw(b'{"model": "x", "prompt": "\xff\xfe"}')),
    ]
    if server.api_key:
        rows.append(("no API key", "/v1/completions", "401", {"json": one, "bare": True}))
    return rows


def _normal_text(client: httpx.Client, normal: dict) -> str | None:
    try:
        r = client.post("/v1/completions", json=normal)
        return r.json()["choices"][0]["text"] if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError, KeyError, IndexError):
        return None


def _after(server: Server, client: httpx.Client, normal: dict, reference: str | None) -> dict:
    health: int | str = "no answer"
    for _ in range(2):  # a connection the server closed after its last reply fails once: ask again
        try:
            health = client.get("/health").status_code
            break
        except httpx.TransportError as e:
            health = type(e).__name__
    return {"health": health, "normal_ok": _normal_text(client, normal) == reference,
            "rss_after_bytes": server.rss(), "peak_bytes": server.peak()}


def attack(server: Server, args) -> list[dict]:
    """Each bad request once, then the session flood; a row per request (see the module docstring)."""
    normal = {"model": server.model, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
    rows: list[dict] = []
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=120.0) as client:
        reference = _normal_text(client, normal)
        rows.append({"request": "(before) a normal request", "expected": "200",
                     "status": 200 if reference is not None else "failed",
                     **_after(server, client, normal, reference)})
        for name, path, expected, kw in attack_requests(server, normal):
            server.reset_peak()
            headers = kw.pop("headers", {})
            bare = kw.pop("bare", False)  # a client of its own, without the key
            t0 = time.monotonic()
            try:
                with httpx.Client(base_url=server.url, timeout=120.0) if bare else contextlib.nullcontext(client) as c:
                    status: int | str = c.post(path, headers=headers, **kw).status_code
            except httpx.HTTPError as e:  # an early refusal may close the connection mid-upload
                status = f"closed ({type(e).__name__})"
            row = {"request": name, "expected": expected, "status": status, "seconds": round(time.monotonic() - t0, 2)}
            rows.append({**row, **_after(server, client, normal, reference)})
        server.reset_peak()
        t0 = time.monotonic()
        codes = asyncio.run(_flood(server, args.attack_sessions))
        row = {"request": f"{args.attack_sessions} distinct session ids (1 token in, 1 out)", "expected": "200",
               "status": ", ".join(f"{k} x{v}" for k, v in sorted(codes.items(), key=str)),
               "seconds": round(time.monotonic() - t0, 1)}
        row.update(_after(server, client, normal, reference))
        metrics = read_metrics(server.url, server.headers)
        files = [n for n in os.listdir(server.session_dir)] if os.path.isdir(server.session_dir) else []
        row["sessions"] = {"files": len(files), "memory": metrics.get('kvslim_sessions{where="memory"}'),
                           "disk": metrics.get('kvslim_sessions{where="disk"}')}
        rows.append(row)
    return rows


async def _flood(server: Server, n: int, concurrency: int = 8) -> dict:
    codes: dict = {}
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=server.url, headers=server.headers, timeout=120.0, limits=limits) as c:

        async def one(i: int) -> None:
            body = {"model": server.model, "prompt": "Hi", "max_tokens": 1, "session": f"flood-{i}"}
            async with sem:
                for _ in range(50):  # 429 (queue full): wait as Retry-After says, then again
                    try:
                        r = await c.post("/v1/completions", json=body)
                        key: int | str = r.status_code
                    except httpx.HTTPError as e:
                        key = type(e).__name__
                        break
                    if key != 429:
                        break
                    await asyncio.sleep(min(float(r.headers.get("retry-after", 1)), 5.0))
            codes[key] = codes.get(key, 0) + 1

        await asyncio.gather(*(one(i) for i in range(n)))
    return codes


def row_ok(r: dict) -> bool:
    """The status expected (an early close counts for 413), /health 200 and the normal text unchanged."""
    status = str(r["status"])
    as_expected = status.split(" ")[0] == r["expected"] and "," not in status
    as_expected |= r["expected"] == "413" and status.startswith("closed")
    return as_expected and r["health"] == 200 and r["normal_ok"]


def print_attack(rows: list[dict]) -> None:
    p = print
    p("\n| request | status (expected) | /health after | normal request after | RSS after (MiB) | peak RSS (MiB) | ok |")
    p("|---|---|---:|---|---:|---:|---|")
    for r in rows:
        p(
            f"| {r['request']} | {r['status']} ({r['expected']}) | {r['health']} | "
            f"{'same text' if r['normal_ok'] else 'WRONG'} | {_mib(r['rss_after_bytes'])} | {_mib(r['peak_bytes'])} | "
            f"{'yes' if row_ok(r) else 'NO'} |"
        )
    for r in rows:
        if "sessions" in r:
            s = r["sessions"]
            p(f"after the flood: {s['files']} files in the session directory, sessions in memory {s['memory']}, "
              f"on disk {s['disk']}")


# -- main ----------------------------------------------------------------------------------


def loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "n/a"


def parse(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="flags after -- go to kvslim serve and kvslim sample (model and cache flags)",
    )
    p.add_argument(
        "--kvslim",
        default=str(Path(sys.executable).with_name("kvslim")),
        help="the kvslim executable (default: beside this Python)",
    )
    p.add_argument("--sessions", type=int, default=16, help="concurrent conversations (default: 16; 0: none, with --attack)")
    p.add_argument("--turns", type=int, default=20, help="turns per conversation (default: 20)")
    p.add_argument("--max-tokens", type=int, default=32, help="max_tokens per turn (default: 32)")
    p.add_argument(
        "--stagger", type=float, default=0.0, metavar="SECONDS",
        help="seconds between the starts of two conversations (default: 0, all at once)",
    )
    p.add_argument(
        "--time-limit",
        type=float,
        default=720.0,
        help="seconds after which no new turn starts (default: 720)",
    )
    p.add_argument(
        "--request-timeout", type=float, default=180.0, help="seconds one request may take (default: 180)"
    )
    p.add_argument("--serve-args", default="", help="extra flags for kvslim serve only, one string")
    p.add_argument("--memory-budget", default=None, metavar="SIZE", help="the server's --memory-budget (e.g. 256MiB)")
    p.add_argument(
        "--api-key", default=os.environ.get("KVSLIM_API_KEY"), metavar="KEY",
        help="the key the servers require (given to them as KVSLIM_API_KEY); every client sends it "
        "(default: the environment's KVSLIM_API_KEY)",
    )
    p.add_argument(
        "--long-prompt", type=int, default=None, metavar="TOKENS",
        help="run the load phase twice, the second time with one more client sending a prompt of about TOKENS "
        "tokens, and compare the other requests' time to first token",
    )
    p.add_argument(
        "--long-prompt-delay", type=float, default=10.0, metavar="SECONDS",
        help="seconds into the second phase the long prompt is sent (default: 10)",
    )
    p.add_argument(
        "--long-prompt-max-tokens", type=int, default=16, help="max_tokens of the long prompt (default: 16)"
    )
    p.add_argument(
        "--long-prompt-cache", default=None, metavar="SPEC",
        help="kvslim_cache of the long prompt's request (default: the server's cache), e.g. int4,sink=4,window=1020",
    )
    p.add_argument(
        "--long-prompt-timeout", type=float, default=1800.0, help="seconds the long prompt may take (default: 1800)"
    )
    p.add_argument("--attack", action="store_true", help="replay issue 29's bad requests first and print the table")
    p.add_argument(
        "--attack-sessions", type=int, default=10_000, metavar="N",
        help="distinct session ids of the attack's session flood (default: 10000)",
    )
    p.add_argument(
        "--greedy-check", action="store_true", help="compare greedy text with kvslim sample afterwards"
    )
    p.add_argument("--greedy-prompt", default="Write a long story about a lighthouse keeper and a storm.")
    p.add_argument(
        "--greedy-text-prompt",
        default="Once upon a time, in a small village by the sea, there lived",
        help="the prompt of the plain-text greedy check (an instruct model ends a bare instruction at once)",
    )
    p.add_argument(
        "--greedy-tokens", type=int, default=200, help="max tokens of the greedy check (default: 200)"
    )
    p.add_argument(
        "--restart-check", action="store_true", help="park a session across a server restart afterwards"
    )
    p.add_argument("--json", default=None, metavar="FILE", help="write every figure and record as JSON")
    p.add_argument("--plot", default=None, metavar="PNG", help="RSS over time and TTFT by turn (matplotlib)")
    args, rest = p.parse_known_args(argv)
    if rest and rest[0] == "--":
        rest = rest[1:]
    for name in ("turns", "max_tokens", "long_prompt_max_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.sessions < 0 or (args.sessions == 0 and not args.attack):
        p.error("--sessions must be >= 1 (or 0 with --attack: the attack table only)")
    if args.sessions == 0 and args.long_prompt is not None:
        p.error("--long-prompt needs conversations to measure (--sessions >= 1)")
    if args.long_prompt is not None and args.long_prompt < 1:
        p.error("--long-prompt must be >= 1 token")
    if args.stagger < 0 or args.long_prompt_delay < 0 or args.attack_sessions < 0:
        p.error("--stagger, --long-prompt-delay and --attack-sessions must be >= 0")
    return args, rest


def main(argv=None) -> int:
    args, flags = parse(argv)
    budget = ["--memory-budget", args.memory_budget] if args.memory_budget else []
    serve_flags = flags + budget + shlex.split(args.serve_args)
    result: dict = {
        "argv": sys.argv[1:],
        "flags": flags,
        "serve_flags": serve_flags,
        "loadavg_before": loadavg(),
        "nproc": os.cpu_count(),
    }
    print(f"load average before: {result['loadavg_before']} ({os.cpu_count()} CPUs)")
    lost = 0
    attack_ok = True
    with tempfile.TemporaryDirectory(prefix="kvslim-load-") as tmp:
        server = Server(
            args.kvslim, serve_flags, os.path.join(tmp, "sessions"), os.path.join(tmp, "serve.log"), args.api_key
        )
        result["server_start_s"] = server.start()
        print(
            f"server up on {server.url} in {result['server_start_s']:.1f} s (RSS {_mib(server.rss())} MiB), serving "
            f"{server.model}; {args.sessions} sessions x {args.turns} turns, max_tokens {args.max_tokens}"
        )
        try:
            result["rss_idle_bytes"] = server.rss()
            if args.attack:
                rows = attack(server, args)
                print_attack(rows)
                result["attack"] = rows
                attack_ok = all(row_ok(r) for r in rows)
                peak = max((r["peak_bytes"] or 0 for r in rows), default=0)
                over = peak - (result["rss_idle_bytes"] or 0)
                print(f"largest peak RSS {_mib(peak)} MiB: {_mib(over)} MiB over the idle server's "
                      f"{_mib(result['rss_idle_bytes'])} MiB (memory budget: {args.memory_budget or 'the default'})")
                result["attack_peak_over_idle_bytes"] = over
            if args.sessions:
                load = asyncio.run(load_phase(server, args))
                s = summarize(load, args)
                metrics = read_metrics(server.url, server.headers)
                lost = s["lost"]
                # nothing lost, from the server's side too: every request it finished is one the client read
                s["server_finished"] = sum(v for k, v in metrics.items() if k.startswith("kvslim_requests_total"))
                print_table(s, metrics)
                print(
                    f"server counted {s['server_finished']:g} requests (every outcome); the client sent {s['requests']}"
                )
                result.update(summary=s, metrics=metrics, rss=load["rss"], records=load["records"])
                if args.long_prompt is not None:
                    text, per_token = long_prompt_text(server, args.long_prompt)
                    print(f"\nsecond phase: the same conversations, and {len(text)} characters sent at "
                          f"{args.long_prompt_delay:g} s")
                    loaded = asyncio.run(load_phase(server, args, prefix="long", long_prompt=text))
                    c = compare_long(load, loaded, loaded["long"], args.long_prompt, per_token)
                    print_long(c)
                    lost += sum(r["outcome"] == "lost" for r in loaded["records"])
                    result["long_prompt"] = {**c, "long": loaded["long"], "records": loaded["records"],
                                             "rss": loaded["rss"], "wall_s": loaded["wall_s"]}
            if args.greedy_check:
                result["greedy"] = greedy_check(server, args, flags, tmp)
                for g in result["greedy"]:
                    if "error" in g:
                        print(f"greedy ({g['mode']}): {g['error']}")
                        continue
                    print(
                        f"greedy ({g['mode']}, {g['endpoint']}): identical {g['identical']} | prompt tokens "
                        f"{g['prompt_tokens']} | completion tokens {g['completion_tokens']} | "
                        f"finish {g['finish_reason']}"
                    )
        finally:
            result["server_stop"] = server.stop()
            print(f"server stopped: {result['server_stop']}")
            if result["server_stop"]["killed"]:
                print(server.tail())
        if args.restart_check:
            rc = restart_check(args, flags + budget, tmp)
            result["restart"] = rc
            if "error" in rc:
                print(f"restart: FAILED ({rc['error']})")
            else:
                print(
                    f"restart: turn 1 prompt {rc['turn1']['prompt_tokens']} tokens; SIGTERM -> exit "
                    f"{rc['first_server_stop']['exit_code']}, {rc['parked_files']} file(s) parked "
                    f"({rc['parked_bytes']} bytes); new server: turn 2 prompt {rc['turn2']['prompt_tokens']} tokens, "
                    f"cached {rc['turn2']['cached_tokens']}, sessions_restored_total "
                    f"{rc['sessions_restored_total'] or 0:g} -> {'ok' if rc['ok'] else 'FAILED'}"
                )
    result["loadavg_after"] = loadavg()
    print(f"load average after: {result['loadavg_after']}")
    if args.plot and "summary" in result:
        title = (
            f"kvslim serve: {args.sessions} sessions x {args.turns} turns, max_tokens {args.max_tokens}, "
            + " ".join(flags)
        )
        plot({"rss": result["rss"]}, result["summary"], args.plot, title)
        print(f"plot: {args.plot}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1, default=str) + "\n")
        print(f"json: {args.json}")
    failed = lost > 0 or result["server_stop"]["killed"] or not attack_ok
    failed |= args.restart_check and not result["restart"]["ok"]
    failed |= args.greedy_check and not all(g.get("identical") for g in result.get("greedy", []))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
