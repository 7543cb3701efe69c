"""``kvslim serve`` as a child process, and a streaming client that times what it receives.

Shared by ``kvslim bench --serve`` (:mod:`kvslim.bench.serve`) and ``scripts/load_test.py``. Everything talks
to 127.0.0.1 only; every wait is bounded (a start timeout, a request timeout, a stop timeout that ends in
SIGKILL). Needs httpx (the ``test`` extra; ``kvslim[serve]``'s clients bring it too).
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx

#: the model id clients send until the server's GET /v1/models names it
MODEL = "SmolLM2-135M-Instruct"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``kvslim serve`` as a child process on 127.0.0.1, on a free port; its log goes to ``log_path``. kvslim:
    the command that runs kvslim (a path, or a list such as ``[sys.executable, "-m", "kvslim.cli"]``). flags:
    the server's flags (model, cache, limits). session_dir: its ``--session-dir`` (None: none). api_key: given
    to the server in its environment (``KVSLIM_API_KEY``, out of the process list) and sent by every client
    (``headers``)."""

    def __init__(self, kvslim: str | list[str], flags: list[str], session_dir: str | None, log_path: str,
                 api_key: str | None = None):
        self.kvslim, self.flags, self.session_dir, self.log_path = kvslim, flags, session_dir, log_path
        self.api_key = api_key
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self.model = MODEL

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 300.0) -> float:
        """Start and wait for /health; returns the seconds it took. RuntimeError (with the log's tail) if it
        exits or does not answer in ``timeout``."""
        self.port = free_port()
        prefix = [self.kvslim] if isinstance(self.kvslim, str) else list(self.kvslim)
        cmd = [*prefix, "serve", "--host", "127.0.0.1", "--port", str(self.port)]
        if self.session_dir is not None:
            cmd += ["--session-dir", self.session_dir]
        cmd += self.flags
        log = open(self.log_path, "a")  # noqa: SIM115 (the child holds it; closed in stop())
        log.write(f"$ {shlex.join(cmd)}{' (KVSLIM_API_KEY set)' if self.api_key else ''}\n")
        log.flush()
        self._log = log
        t0 = time.monotonic()
        env = {k: v for k, v in os.environ.items() if k != "KVSLIM_API_KEY"}
        if self.api_key:
            env["KVSLIM_API_KEY"] = self.api_key
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
        with httpx.Client(base_url=self.url, timeout=2.0, headers=self.headers) as client:
            while time.monotonic() - t0 < timeout:
                if self.proc.poll() is not None:
                    raise RuntimeError(
                        f"kvslim serve exited ({self.proc.returncode}) before answering:\n{self.tail()}"
                    )
                try:
                    if client.get("/health").status_code == 200:
                        took = time.monotonic() - t0
                        models = client.get("/v1/models", timeout=30.0).json().get("data") or []
                        self.model = models[0]["id"] if models else MODEL
                        return took
                except (httpx.HTTPError, ValueError, KeyError):
                    pass
                time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"kvslim serve did not answer /health in {timeout:.0f} s:\n{self.tail()}")

    def rss(self, key: str = "VmRSS") -> int | None:
        """VmRSS (or another ``/proc/PID/status`` size, e.g. ``VmHWM``) in bytes, or None once the process is gone."""
        try:
            with open(f"/proc/{self.proc.pid}/status") as f:
                for line in f:
                    if line.startswith(key + ":"):
                        return int(line.split()[1]) * 1024
        except (OSError, ValueError, AttributeError):
            return None
        return None

    def peak(self) -> int | None:
        """The peak RSS (``VmHWM``) since the process started or the last :meth:`reset_peak`."""
        return self.rss("VmHWM")

    def reset_peak(self) -> bool:
        """Reset ``VmHWM`` to the current RSS (``/proc/PID/clear_refs``); False where the kernel refuses."""
        try:
            with open(f"/proc/{self.proc.pid}/clear_refs", "w") as f:
                f.write("5")
            return True
        except OSError:
            return False

    def stop(self, timeout: float = 60.0) -> dict:
        """SIGTERM, then wait: ``{"exit_code", "stop_s", "killed"}`` (killed: it did not exit in ``timeout``)."""
        if self.proc is None:
            return {"exit_code": None, "stop_s": 0.0, "killed": False}
        t0 = time.monotonic()
        killed = False
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
                killed = True
        self._log.close()
        return {
            "exit_code": self.proc.returncode,
            "stop_s": round(time.monotonic() - t0, 2),
            "killed": killed,
        }

    def tail(self, n: int = 20) -> str:
        try:
            return "\n".join(Path(self.log_path).read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


def read_metrics(url: str, headers: dict | None = None) -> dict[str, float]:
    """``/metrics`` as ``{"name{labels}": value}`` (comments dropped)."""
    text = httpx.get(f"{url}/metrics", timeout=30.0, headers=headers or {}).text
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


async def stream_request(
    client: httpx.AsyncClient, path: str, body: dict, *, timeout: float, t_origin: float, record: dict | None = None
) -> dict:
    """One streamed request (chat or text completion) to ``path`` with ``body``; the record of what happened
    (never raises): ``outcome`` (answered, refused or lost) and its ``reason``, ``ttft_s`` (to the first chunk
    with text), ``itl_s`` (the gaps between chunks with text), ``times_s`` (their arrival, seconds since
    ``t_origin``, a ``time.perf_counter()`` value), the text, the finish reason and the usage. record: a dict to
    fill as the reply streams (a caller watching the chunks arrive), returned."""
    rec = {} if record is None else record
    rec |= {
        "outcome": "lost",
        "reason": None,
        "ttft_s": None,
        "first_token_s": None,  # the first chunk with text or a finish_reason (a reply may start with no text)
        "itl_s": [],
        "text": "",
        "finish": None,
        "prompt_tokens": None,
        "cached_tokens": None,
        "completion_tokens": None,
        "times_s": [],  # when each chunk with text arrived, seconds since t_origin
    }
    t0 = time.perf_counter()
    rec["start_s"] = t0 - t_origin
    parts: list[str] = []
    state = {"done": False, "last": None}

    async def read() -> None:
        async with client.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                raw = await r.aread()
                try:
                    msg = json.loads(raw)["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    msg = raw[:200].decode(errors="replace")
                rec.update(outcome="refused", reason=f"HTTP {r.status_code}: {msg}")
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    state["done"] = True
                    return
                obj = json.loads(data)
                if "error" in obj:
                    rec.update(outcome="refused", reason=f"error event: {obj['error'].get('message')}")
                    continue
                if obj.get("usage"):
                    u = obj["usage"]
                    rec["prompt_tokens"] = u.get("prompt_tokens")
                    rec["completion_tokens"] = u.get("completion_tokens")
                    rec["cached_tokens"] = (u.get("prompt_tokens_details") or {}).get("cached_tokens")
                for choice in obj.get("choices", []):
                    content = (choice.get("delta") or {}).get("content") or choice.get("text")
                    if content:
                        now = time.perf_counter()
                        if rec["ttft_s"] is None:
                            rec["ttft_s"] = now - t0
                        else:
                            rec["itl_s"].append(round(now - state["last"], 5))
                        state["last"] = now
                        rec["times_s"].append(now - t_origin)
                        parts.append(content)
                    if choice.get("finish_reason"):
                        rec["finish"] = choice["finish_reason"]
                    if (content or choice.get("finish_reason")) and rec["first_token_s"] is None:
                        rec["first_token_s"] = time.perf_counter() - t0

    try:
        await asyncio.wait_for(read(), timeout)
    except asyncio.TimeoutError:
        rec["reason"] = f"no complete reply in {timeout:.0f} s"
    except (httpx.HTTPError, ValueError) as e:  # ValueError: a chunk that is not JSON
        rec["reason"] = f"{type(e).__name__}: {e}"
    rec["end_s"] = time.perf_counter() - t_origin
    rec["text"] = "".join(parts)
    if rec["outcome"] == "lost" and state["done"]:
        if rec["finish"] is not None:
            rec["outcome"] = "answered"
        else:
            rec["reason"] = "[DONE] without a finish_reason"
    elif rec["outcome"] == "lost" and rec["reason"] is None:
        rec["reason"] = "the stream ended without [DONE]"
    return rec



def pct(xs: list[float], q: float) -> float | None:
    """The q-th percentile (0..100), linear between order statistics; None for no data."""
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)
