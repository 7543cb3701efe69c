"""``GET /metrics``: the runner's figures as Prometheus text exposition (version 0.0.4)."""

from __future__ import annotations


def prometheus(m: dict) -> str:
    """The runner's figures (:meth:`Runner.metrics`) as Prometheus text exposition."""
    mem = m["memory"]
    lines: list[str] = []

    def metric(name: str, kind: str, help_: str, samples) -> None:
        lines.append(f"# HELP {name} {help_}")
        lines.append(f"# TYPE {name} {kind}")
        for labels, value in samples:
            lines.append(f"{name}{labels} {value}")

    metric("kvslim_requests_total", "counter", "requests by outcome (refused: a 4xx before generating)",
           [(f'{{outcome="{k}"}}', v) for k, v in sorted(m["outcomes"].items())])
    metric("kvslim_prompt_tokens_total", "counter", "prompt tokens of finished requests", [("", m["prompt_tokens"])])
    metric("kvslim_cached_prompt_tokens_total", "counter", "prompt tokens a kept session already held (not prefilled)",
           [("", m["cached_tokens"])])
    metric("kvslim_prefilled_tokens_total", "counter", "prompt tokens fed through prefill", [("", mem["prefilled_tokens"])])
    metric("kvslim_generated_tokens_total", "counter", "tokens generated", [("", m["generated_tokens"])])
    metric("kvslim_active_streams", "gauge", "requests in flight (waiting or running)", [("", m["active_streams"])])
    metric("kvslim_queue_length", "gauge", "requests waiting for admission", [("", mem["waiting"])])
    metric("kvslim_running_requests", "gauge", "requests admitted (prefilling or decoding)", [("", mem["active"])])
    metric("kvslim_cache_bytes", "gauge", "bytes held by caches: running requests and idle sessions in memory",
           [('{where="running"}', mem["cache_bytes"]), ('{where="sessions"}', mem["session_bytes"])])
    metric("kvslim_cache_fp16_bytes", "gauge",
           "bytes plain fp16 caches of the same tokens would hold (no window, no compression)", [("", mem["fp16_bytes"])])
    metric("kvslim_reserved_bytes", "gauge", "bytes reserved by admission for running requests", [("", mem["reserved_bytes"])])
    metric("kvslim_kept_decoded_bytes", "gauge", "bytes of the decoded K/V copies kept while long prompts are read",
           [("", mem["kept_decoded_bytes"])])
    metric("kvslim_packed_weight_bytes", "gauge", "bytes of the weights' second copy packed for oneDNN (--linears packed)",
           [("", mem["packed_weight_bytes"])])
    if mem["memory_budget"] is not None:
        metric("kvslim_memory_budget_bytes", "gauge", "the memory budget", [("", mem["memory_budget"])])
    metric("kvslim_sessions", "gauge", "sessions kept", [('{where="memory"}', mem["sessions_kept"]),
                                                          ('{where="disk"}', mem["sessions_on_disk"])])
    known = {
        "continued": "requests that continued a kept session",
        "reset": "session caches dropped because the prompt did not continue them",
        "evicted": "idle sessions written to disk to make room",
        "restored": "sessions read back from disk",
        "dropped": "idle sessions dropped (no session dir, a failed request or an unreadable file)",
        "expired": "idle sessions removed after --session-ttl",
        "deleted": "sessions removed by DELETE /v1/sessions/{id}",
        "discarded": "sessions removed, least recently used first, to stay within --max-sessions",
        "reused_tokens": "prompt tokens a continued session did not prefill",
        "written": "session files written",
        "write_failed": "session file writes that failed (logged)",
    }
    counters = sorted(k.removeprefix("sessions_") for k in mem if k.startswith("sessions_")
                      and k not in ("sessions_kept", "sessions_on_disk"))
    for key in sorted(set(known) | set(counters), key=lambda k: (k not in known, k)):
        if f"sessions_{key}" in mem:
            metric(f"kvslim_sessions_{key}_total", "counter", known.get(key, f"sessions {key.replace('_', ' ')}"),
                   [("", mem[f"sessions_{key}"])])
    if "refusals" in m:
        metric("kvslim_refusals_total", "counter",
               "refused requests by why (access: Host, key or content type; request: a bad body or field; the "
               "engine's kinds: input, settings, context, budget, queue)",
               [(f'{{kind="{k}"}}', v) for k, v in sorted(m["refusals"].items())])
    if "engine_errors" in m:
        metric("kvslim_engine_errors_total", "counter", "engine steps that raised (their rows ended with an error)",
               [("", m["engine_errors"])])
    if "row_errors" in mem:
        metric("kvslim_row_errors_total", "counter", "requests ended by a failure of their own row",
               [("", mem["row_errors"])])
    metric("kvslim_up", "gauge", "1 while the engine thread runs and takes requests", [("", int(m["alive"]))])
    return "\n".join(lines) + "\n"
