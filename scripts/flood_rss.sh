#!/bin/bash
# The session flood's memory over time (docs/serving.md, "The attack table"): starts `kvslim serve` on
# 127.0.0.1 with --session-dir in a temporary directory and --memory-budget $BUDGET (default 256MiB),
# sends N one-turn requests ("Hi", max_tokens 1), 8 at a time, each with its own session id (NOSESS=1: no
# session), samples the server's RSS every 5 s, prints the RSS at the end and its peak (VmHWM), the RSS after
# glibc's malloc_trim(0) (through gdb, when installed), then stops the server with SIGTERM.
#   BUDGET=64MiB scripts/flood_rss.sh 800          # N requests; a second argument: env for the server
# Bounded: N requests, each with a 120 s timeout; loopback only.
set -u
cd "$(dirname "$0")/.."
N=${1:-2500}
EXTRA=${2:-}
PORT=${PORT:-18765}
D=$(mktemp -d)
trap 'rm -rf "$D"' EXIT
env $EXTRA .venv/bin/kvslim serve --port "$PORT" --session-dir "$D/s" --memory-budget "${BUDGET:-256MiB}" > "$D/log" 2>&1 &
SP=$!
for _ in $(seq 120); do curl -s "localhost:$PORT/health" >/dev/null && break; sleep 1; done
echo "idle RSS $(grep VmRSS /proc/$SP/status)"
( while kill -0 $SP 2>/dev/null; do echo "$(date +%s) $(grep VmRSS /proc/$SP/status | awk '{print $2}')"; sleep 5; done ) > "$D/rss" &
PORT=$PORT N=$N NOSESS=${NOSESS:-} .venv/bin/python - <<'PY'
import asyncio, os, time

import httpx

async def main():
    port, n, nosess = os.environ["PORT"], int(os.environ["N"]), bool(os.environ["NOSESS"])
    sem = asyncio.Semaphore(8)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=120) as c:
        async def one(i):
            body = {"model": "SmolLM2-135M-Instruct", "prompt": "Hi", "max_tokens": 1}
            if not nosess:
                body["session"] = f"f-{i}"
            async with sem:
                return (await c.post("/v1/completions", json=body)).status_code
        t = time.time()
        codes = await asyncio.gather(*(one(i) for i in range(n)))
        print({c: codes.count(c) for c in set(codes)}, round(time.time() - t, 1), "s")

asyncio.run(main())
PY
sleep 6
echo "end RSS $(grep VmRSS /proc/$SP/status) HWM $(grep VmHWM /proc/$SP/status)"
if command -v gdb >/dev/null; then
    gdb -p $SP -batch -ex "call (int)malloc_trim(0)" >/dev/null 2>&1
    echo "after malloc_trim $(grep VmRSS /proc/$SP/status)"
fi
kill -TERM $SP; wait $SP
echo "server exit status $?"
echo "RSS samples (unix time, KiB), every 30 s: $(awk 'NR%6==1' "$D/rss" | tr '\n' ';')"
echo "session files: $(ls "$D/s" | wc -l)"
