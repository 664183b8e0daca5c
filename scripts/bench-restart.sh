#!/usr/bin/env bash
# What a restart costs a node's cache, and what the warm-restart snapshot
# (tiers.host.snapshot_file) gives back, measured on the Mooncake conversation trace:
#
#   scripts/bench-restart.sh [--quick] [--budget=1000] [--sample_one_in=32] [--before=195]
#                            [--window=40] [--tokens_per_block=16]
#
# For each of three runs, one proximad (host tier of --budget raw blocks, the default segmented
# LRU) gets the sample's first --before requests replayed through it (proxima_replay: lookups,
# gets checked byte for byte, puts of the misses, as a prefix-caching engine does); then
#   none:     nothing happens (the baseline: the same daemon goes on);
#   snapshot: SIGTERM, and a new proximad started with the snapshot file the stop wrote;
#   cold:     SIGTERM, and a new proximad started without one (what a restart cost before);
# and the next --window requests are replayed ("window": the cache right after the restart),
# then the rest of the sample ("rest"). Printed: one JSON line per replayed part, then a table:
# the hit ratio of each part per run, and of the snapshot and cold runs as a ratio to none, the
# restart's seconds (SIGTERM to serving again) and the snapshot's blocks and load seconds from
# the new daemon's metrics. The snapshot run must hit exactly as the run without a restart does
# (it brings back the blocks and their order of use, and the replay is deterministic), or the
# benchmark fails. A cold restart is not always worse: where the tier is too small to hold much
# reuse across the restart, an empty tier leaves the next requests more room for their own.
# --quick (the ctest smoke test): 2-token blocks, a small sample.
#
# Env: PROXIMA_BENCH_BUILD_DIR (default build-bench/), PROXIMA_TRACE (the trace file).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${PROXIMA_BENCH_BUILD_DIR:-$root/build-bench}
trace=${PROXIMA_TRACE:-$root/../shared/data/mooncake_conversation_trace.jsonl}
kv=$root/tools/eval/testdata/smollm2-135m_gpl3_t0-256_bf16.pkv

budget=1000
sample=32
before=195
window=40
tpb=16
for arg in "$@"; do
  case "$arg" in
    --quick) budget=150; sample=64; before=60; window=20; tpb=2 ;;
    --budget=*) budget=${arg#*=} ;;
    --sample_one_in=*) sample=${arg#*=} ;;
    --before=*) before=${arg#*=} ;;
    --window=*) window=${arg#*=} ;;
    --tokens_per_block=*) tpb=${arg#*=} ;;
    *) echo "bench-restart.sh: unknown argument '$arg' (see the header of $0)" >&2; exit 2 ;;
  esac
done
[[ -f $trace ]] || { echo "bench-restart.sh: trace file '$trace' not found (set PROXIMA_TRACE)" >&2; exit 1; }
for bin in daemon/proximad tools/replay/proxima_replay; do
  [[ -x $build/$bin ]] || { echo "bench-restart.sh: $build/$bin not built" >&2; exit 1; }
done
# SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64, bf16.
block_bytes=$((2 * 30 * 3 * 64 * 2 * tpb))

work=$(mktemp -d /tmp/proxima-restart-XXXXXX)
daemon_pid=
cleanup() {
  if [[ -n $daemon_pid ]]; then kill -KILL "$daemon_pid" 2>/dev/null || true; wait "$daemon_pid" 2>/dev/null || true; fi
  rm -rf "$work"
}
trap cleanup EXIT

# start DIR [--set ...]: a proximad on a Unix socket in DIR; waits until it serves.
start() {
  local dir=$1
  shift
  rm -f "$dir/ports.json"
  "$build/daemon/proximad" --set "server.unix_socket=$dir/sock" --set server.listen= \
    --set server.metrics_listen=127.0.0.1:0 \
    --set "tiers.host.capacity_bytes=$((budget * block_bytes))" "$@" \
    --port_file="$dir/ports.json" 2>> "$dir/proximad.log" &
  daemon_pid=$!
  for _ in $(seq 600); do [[ -s $dir/ports.json ]] && return 0; sleep 0.05; done
  echo "bench-restart.sh: proximad did not start; its log:" >&2
  tail -n 20 "$dir/proximad.log" >&2
  exit 1
}

stop() {
  kill -TERM "$daemon_pid"
  wait "$daemon_pid" || { echo "bench-restart.sh: proximad did not exit 0 on SIGTERM" >&2; exit 1; }
  daemon_pid=
}

# replay DIR LABEL FIRST MAX: requests [FIRST, FIRST + MAX) of the sample (MAX 0: to the end).
replay() {
  local dir=$1 label=$2 first=$3 max=$4
  "$build/tools/replay/proxima_replay" --target="unix:$dir/sock" --trace="$trace" --kv_file="$kv" \
    --tokens_per_block="$tpb" --sample_one_in="$sample" --first_request="$first" \
    --max_requests="$max" --label="$label" >> "$work/results.jsonl" || {
    echo "bench-restart.sh: replay $label failed (exit $?)" >&2
    exit 1
  }
}

# metric DIR NAME: the value of series NAME at the daemon's metrics endpoint.
metric() { "$root/scripts/metric-value.py" "$1/ports.json" "$2"; }

for run in none snapshot cold; do
  dir=$work/$run
  mkdir -p "$dir"
  snapshot=()
  [[ $run == snapshot ]] && snapshot=(--set "tiers.host.snapshot_file=$dir/snapshot")
  start "$dir" "${snapshot[@]}"
  replay "$dir" "$run/before" 0 "$before"
  restart_s=0
  if [[ $run != none ]]; then
    t0=$(date +%s.%N)
    stop
    start "$dir" "${snapshot[@]}"
    restart_s=$(python3 -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.3f}')" "$t0" "$(date +%s.%N)")
  fi
  loaded=0 load_s=0
  if [[ $run == snapshot ]]; then
    loaded=$(metric "$dir" proxima_snapshot_loaded_blocks)
    load_s=$(metric "$dir" proxima_snapshot_load_seconds)
  fi
  printf '{"bench":"restart_run","run":"%s","restart_s":%s,"snapshot_loaded_blocks":%s,"snapshot_load_s":%s}\n' \
    "$run" "$restart_s" "$loaded" "$load_s" >> "$work/results.jsonl"
  replay "$dir" "$run/window" "$before" "$window"
  replay "$dir" "$run/rest" $((before + window)) 0
  stop
done

python3 - "$work/results.jsonl" "$budget" "$sample" "$before" "$window" "$tpb" "$block_bytes" <<'EOF'
import json, sys
path, budget, sample, before, window, tpb, block_bytes = sys.argv[1], *map(int, sys.argv[2:])
parts, runs = {}, {}
for line in open(path):
    r = json.loads(line)
    print(json.dumps(r, sort_keys=True))
    if r["bench"] == "replay":
        run, part = r["run"].split("/")
        parts[(run, part)] = r
    else:
        runs[r["run"]] = r
for key, r in parts.items():
    if r["bad"] != 0 or r["crc_failures_client"] != 0:
        sys.exit(f"bench-restart.sh: {key} got {r['bad']} wrong blocks, "
                 f"{r['crc_failures_client']} CRC failures")
# Sanity: the snapshot run must have loaded blocks, and, since the snapshot brings back the
# blocks and their order of use (the segmented LRU's segments included) and the replay is
# deterministic, must hit exactly as the run without a restart does, block for block.
if float(runs["snapshot"]["snapshot_loaded_blocks"]) <= 0:
    sys.exit("bench-restart.sh: the snapshot run loaded no blocks")
for part in ("window", "rest"):
    if parts[("snapshot", part)]["hits"] != parts[("none", part)]["hits"]:
        sys.exit(f"bench-restart.sh: after the restart with the snapshot, the {part} got "
                 f"{parts[('snapshot', part)]['hits']} hits, without a restart "
                 f"{parts[('none', part)]['hits']}: the snapshot did not bring the cache back as it was")
for run in ("none", "snapshot", "cold"):
    for part in ("window", "rest"):
        base = parts[("none", part)]["hit_ratio"]
        mine = parts[(run, part)]["hit_ratio"]
        print(json.dumps({"bench": "restart", "run": run, "part": part, "hit_ratio": mine,
                          "baseline": "none", "baseline_hit_ratio": base,
                          "ratio": mine / base if base else None}, sort_keys=True))
print()
print(f"# {before} requests, then a restart, then {window} ('window') and "
      f"{parts[('none', 'rest')]['requests']} more ('rest'): the Mooncake trace, 1 prefix family "
      f"in {sample}; host tier of {budget} blocks of {tpb} tokens of real SmolLM2-135M KV "
      f"({budget * block_bytes / 2**20:.0f} MiB)")
print()
print("| run | restart s | snapshot blocks loaded | load s | hit ratio, window | vs none | "
      "hit ratio, rest | vs none |")
print("|---|---|---|---|---|---|---|---|")
for run in ("none", "snapshot", "cold"):
    w, rest = parts[(run, "window")], parts[(run, "rest")]
    bw, br = parts[("none", "window")]["hit_ratio"], parts[("none", "rest")]["hit_ratio"]
    ratio = lambda a, b: f"{a / b:.3f}" if b else "n/a"
    info = runs[run]
    print(f"| {run} | {info['restart_s']} | {info['snapshot_loaded_blocks']} | "
          f"{info['snapshot_load_s']} | {w['hit_ratio']:.4f} | {ratio(w['hit_ratio'], bw)} | "
          f"{rest['hit_ratio']:.4f} | {ratio(rest['hit_ratio'], br)} |")
EOF
