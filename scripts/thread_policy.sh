#!/usr/bin/env bash
# The OpenMP wait policy measured (issue 30, item 6): the engine's many-stream decode step under each
# policy (passive, active, the runtime's default), on a quiet machine and with BUSY competing processes
# keeping the cores busy, one `kvslim bench --concurrency` per cell, then one table.
#
#   scripts/thread_policy.sh                      # 16 streams x 4,096 tokens, int4, 2 threads, 2 busy loops
#   CONC=4 LENGTH=512 STEPS=5 scripts/thread_policy.sh   # a shorter run
#   SMOKE=1 scripts/thread_policy.sh              # seconds: the tiny settings, to check the script runs
#   PEERS=openvino WAITS=passive LENGTH=1024 scripts/thread_policy.sh  # and OpenVINO GenAI beside the same load
#   BENCH_FLAGS="--pages --compile" PEERS=openvino WAITS=passive LENGTH=1024 scripts/thread_policy.sh  # pages rows too
#
# Settings (environment): KVSLIM (default: .venv/bin/kvslim), CONFIG (int4), CONC (16), LENGTH (4096),
# STEPS (10), THREADS (2), BUSY (2), OUT (out/thread-policy), MODEL (--model; default the embedded model), WAITS (the
# policies to run, default "passive active runtime"), PEERS (serving peers, space-separated as `kvslim bench --peers` takes them, run with the
# first policy of WAITS: each in its own process, beside the same busy loops, and in the table as rows of their own),
# BENCH_FLAGS (more `kvslim bench` flags, e.g. "--pages --compile": the CONFIG+pages rows get rows of their own).
# Run it on a machine nobody else is using: the "quiet" column is only quiet if the machine is.
# The busy loops are this script's children, ended by their PIDs when it exits (also on Ctrl-C).
set -euo pipefail

KVSLIM=${KVSLIM:-.venv/bin/kvslim}
CONFIG=${CONFIG:-int4}
CONC=${CONC:-16}
LENGTH=${LENGTH:-4096}
STEPS=${STEPS:-10}
THREADS=${THREADS:-2}
BUSY=${BUSY:-2}
OUT=${OUT:-out/thread-policy}
WAITS=${WAITS:-passive active runtime}
PEERS=${PEERS:-}
read -r -a BENCH_EXTRA <<< "${BENCH_FLAGS:-}"
MODEL_FLAGS=()
[ -n "${MODEL:-}" ] && MODEL_FLAGS=(--model "$MODEL")
if [ -n "${SMOKE:-}" ]; then CONC=2; LENGTH=32; STEPS=3; fi
mkdir -p "$OUT"
unset OMP_WAIT_POLICY  # each run chooses its own with --omp-wait

busy_pids=()
stop_busy() {
    for pid in "${busy_pids[@]}"; do kill "$pid" 2>/dev/null || true; done
    for pid in "${busy_pids[@]}"; do wait "$pid" 2>/dev/null || true; done
    busy_pids=()
}
trap stop_busy EXIT INT TERM

for load in quiet busy; do
    if [ "$load" = busy ]; then
        for _ in $(seq "$BUSY"); do python3 -c 'while True: pass' & busy_pids+=($!); done
        sleep 2
    fi
    peer_flags=()
    [ -n "$PEERS" ] && peer_flags=(--peers $PEERS)
    for wait in $WAITS; do
        echo "== $load, --omp-wait $wait: $CONC x $LENGTH $CONFIG, $THREADS threads ${peer_flags[*]}" >&2
        "$KVSLIM" bench "${MODEL_FLAGS[@]}" --concurrency "$CONC" --lengths "$LENGTH" --config "$CONFIG" \
            --steps "$STEPS" --warmup 1 --threads "$THREADS" --omp-wait "$wait" --no-continuous-batching \
            "${peer_flags[@]}" "${BENCH_EXTRA[@]}" --quiet --json "$OUT/$load-$wait.json" > "$OUT/$load-$wait.txt"
        peer_flags=()  # the peers run once, with the first policy
    done
    stop_busy
done

python3 - "$OUT" "$CONFIG" $WAITS <<'EOF'
import json, os, sys
out, config, waits = sys.argv[1], sys.argv[2], sys.argv[3:]
rows = {}
for load in ("quiet", "busy"):
    for wait in waits:
        with open(os.path.join(out, f"{load}-{wait}.json")) as f:
            d = json.load(f)
        for r in d["concurrency"]:  # kvslim's rows under this policy; a peer's rows under their own names
            if r["mode"] == config:
                rows[load, wait] = (r, d["thread_policy"])
            elif r["mode"].startswith(config + "+pages"):  # (BENCH_FLAGS="--pages ...")
                rows[load, f"{wait} {r['mode'][len(config):]}"] = (r, d["thread_policy"])
            elif r["mode"].split(" ", 1)[0] in ("openvino", "vllm") and r.get("ms_median"):
                rows[load, r["mode"]] = (r, d["thread_policy"])
print(f"| --omp-wait (or peer) | quiet ms/step | busy ms/step | busy / quiet | load avg (busy, before -> after) |")
print("|---|---:|---:|---:|---|")
names = [*waits, *sorted({k[1] for k in rows if k[1] not in waits and k[1].split(" ", 1)[0] in waits}),
         *sorted({k[1] for k in rows if k[1].split(" ", 1)[0] not in waits})]
for name in names:
    if ("quiet", name) not in rows or ("busy", name) not in rows:
        continue
    q, b = rows["quiet", name][0], rows["busy", name][0]
    pol = rows["busy", name][1]
    la = lambda x: "n/a" if x is None else f"{x[0]:.2f}"
    print(f"| {name} | {q['ms_median']:.1f} | {b['ms_median']:.1f} | {b['ms_median'] / q['ms_median']:.2f}x "
          f"| {la(pol['load_average'])} -> {la(pol['load_average_after'])} |")
first = rows["quiet", waits[0]]
print(f"\n{config}, {first[0]['concurrency']} streams x {first[0]['length']} tokens, {first[1]['torch_threads']} "
      f"threads; JSON and text in {out}/")
EOF
