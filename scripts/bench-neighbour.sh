#!/usr/bin/env bash
# A noisy neighbour and namespaces[].max_bytes, measured on the Mooncake conversation trace:
#
#   scripts/bench-neighbour.sh [--budget=1000] [--sample_one_in=32] [--limit_share=0.1]
#                              [--flood_clients=2] [--tokens_per_block=16]
#
# One proximad (host tier of --budget raw blocks of 16-token SmolLM2 KV, the default segmented
# LRU) with two namespaces: "app" gets the trace replayed through it (proxima_replay: lookups,
# gets checked byte for byte, puts of the misses, as a prefix-caching engine does) and "bulk"
# gets a flood of puts of new blocks (proximactl load --get_fraction=0 with a working set far
# larger than the tier) for as long as the replay runs. Three runs, each on a fresh daemon:
#   alone:    the replay without the flood (the baseline);
#   uncapped: with the flood, "bulk" without a limit (every namespace before stop 58);
#   capped:   with the flood, "bulk" limited to --limit_share of the tier (max_bytes).
# Printed: the replay's JSON line per run (plus the flood's bytes and the namespaces' bytes at
# the end), then a table of app's hit ratio per run and as a ratio to alone. The flood's pace
# depends on the machine; the run fails if the capped run's "bulk" ends above its limit.
#
# Env: PROXIMA_BENCH_BUILD_DIR (default build-bench/), PROXIMA_TRACE (the trace file).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${PROXIMA_BENCH_BUILD_DIR:-$root/build-bench}
trace=${PROXIMA_TRACE:-$root/../shared/data/mooncake_conversation_trace.jsonl}
kv=$root/tools/eval/testdata/smollm2-135m_gpl3_t0-256_bf16.pkv

budget=1000
sample=32
share=0.1
flood_clients=2
tpb=16
for arg in "$@"; do
  case "$arg" in
    --budget=*) budget=${arg#*=} ;;
    --sample_one_in=*) sample=${arg#*=} ;;
    --limit_share=*) share=${arg#*=} ;;
    --flood_clients=*) flood_clients=${arg#*=} ;;
    --tokens_per_block=*) tpb=${arg#*=} ;;
    *) echo "bench-neighbour.sh: unknown argument '$arg' (see the header of $0)" >&2; exit 2 ;;
  esac
done
[[ -f $trace ]] || { echo "bench-neighbour.sh: trace file '$trace' not found (set PROXIMA_TRACE)" >&2; exit 1; }
for bin in daemon/proximad tools/replay/proxima_replay tools/proximactl/proximactl; do
  [[ -x $build/$bin ]] || { echo "bench-neighbour.sh: $build/$bin not built" >&2; exit 1; }
done
block_bytes=$((2 * 30 * 3 * 64 * 2 * tpb))  # SmolLM2-135M, bf16
capacity=$((budget * block_bytes))
limit=$(python3 -c "import sys; print(int(float(sys.argv[1]) * int(sys.argv[2])))" "$share" "$capacity")

work=$(mktemp -d /tmp/proxima-neighbour-XXXXXX)
daemon_pid=
flood_pid=
cleanup() {
  [[ -n $flood_pid ]] && { kill -KILL "$flood_pid" 2>/dev/null || true; wait "$flood_pid" 2>/dev/null || true; }
  [[ -n $daemon_pid ]] && { kill -KILL "$daemon_pid" 2>/dev/null || true; wait "$daemon_pid" 2>/dev/null || true; }
  rm -rf "$work"
}
trap cleanup EXIT

metric() { "$root/scripts/metric-value.py" "$1/ports.json" "$2"; }  # DIR SERIES

for run in alone uncapped capped; do
  dir=$work/$run
  mkdir -p "$dir"
  bulk="{name: bulk}"
  [[ $run == capped ]] && bulk="{name: bulk, max_bytes: $limit}"
  "$build/daemon/proximad" --set "server.unix_socket=$dir/sock" --set server.listen= \
    --set server.metrics_listen=127.0.0.1:0 --set "tiers.host.capacity_bytes=$capacity" \
    --set "namespaces=[{name: app}, $bulk]" --port_file="$dir/ports.json" 2> "$dir/proximad.log" &
  daemon_pid=$!
  for _ in $(seq 600); do [[ -s $dir/ports.json ]] && break; sleep 0.05; done
  [[ -s $dir/ports.json ]] || { tail -n 20 "$dir/proximad.log" >&2; exit 1; }
  if [[ $run != alone ]]; then
    "$build/tools/proximactl/proximactl" load --target="unix:$dir/sock" --ns=bulk \
      --clients="$flood_clients" --get_fraction=0 --working_set=1000000 --duration=600 --json \
      > "$dir/flood.json" 2> "$dir/flood.log" &
    flood_pid=$!
    sleep 2  # the flood under way before the replay starts
  fi
  "$build/tools/replay/proxima_replay" --target="unix:$dir/sock" --ns=app --trace="$trace" \
    --kv_file="$kv" --tokens_per_block="$tpb" --sample_one_in="$sample" --label="$run" \
    > "$dir/replay.json" || { echo "bench-neighbour.sh: replay $run failed" >&2; exit 1; }
  app_bytes=$(metric "$dir" 'proxima_namespace_bytes{namespace="app"}')
  bulk_bytes=$(metric "$dir" 'proxima_namespace_bytes{namespace="bulk"}')
  bulk_in=$(metric "$dir" 'proxima_transfer_bytes_total{transport="ucx",direction="in"}')
  bulk_inline=$(metric "$dir" 'proxima_transfer_bytes_total{transport="grpc_inline",direction="in"}')
  if [[ -n $flood_pid ]]; then kill -KILL "$flood_pid" 2>/dev/null || true; wait "$flood_pid" 2>/dev/null || true; flood_pid=; fi
  kill -TERM "$daemon_pid"; wait "$daemon_pid" || true; daemon_pid=
  python3 - "$dir/replay.json" "$run" "$app_bytes" "$bulk_bytes" "$bulk_in" "$bulk_inline" "$limit" \
    >> "$work/results.jsonl" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
r.update(bench="neighbour", flood=sys.argv[2] != "alone", app_bytes_end=float(sys.argv[3]),
         bulk_bytes_end=float(sys.argv[4]),
         bytes_put_total=float(sys.argv[5]) + float(sys.argv[6]),
         bulk_max_bytes=int(sys.argv[7]) if sys.argv[2] == "capped" else 0)
print(json.dumps(r, sort_keys=True))
EOF
done

python3 - "$work/results.jsonl" "$budget" "$block_bytes" "$share" "$flood_clients" <<'EOF'
import json, sys
runs = {}
for line in open(sys.argv[1]):
    r = json.loads(line)
    print(line.rstrip())
    runs[r["run"]] = r
budget, block_bytes, share, clients = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
capped = runs["capped"]
if capped["bulk_bytes_end"] > capped["bulk_max_bytes"]:
    sys.exit(f"bench-neighbour.sh: bulk held {capped['bulk_bytes_end']:.0f} bytes, "
             f"over its limit of {capped['bulk_max_bytes']}")
for r in runs.values():
    if r["bad"] != 0 or r["crc_failures_client"] != 0:
        sys.exit(f"bench-neighbour.sh: run {r['run']} got wrong blocks")
base = runs["alone"]["hit_ratio"]
for name in ("alone", "uncapped", "capped"):
    r = runs[name]
    print(json.dumps({"bench": "neighbour", "run": name, "hit_ratio": r["hit_ratio"],
                      "baseline": "alone", "baseline_hit_ratio": base,
                      "ratio": r["hit_ratio"] / base if base else None}, sort_keys=True))
print()
print(f"# app: {runs['alone']['requests']} requests of the Mooncake trace (1 prefix family in "
      f"{runs['alone']['sample_one_in']:.0f}); bulk: {clients} proximactl load clients putting "
      f"new 256 KiB blocks; host tier of {budget} blocks ({budget * block_bytes / 2**20:.0f} MiB); "
      f"capped: bulk max_bytes = {share} of it")
print()
print("| run | app hit ratio | vs alone | app wall s | bytes put during the run (both) | "
      "app MiB at the end | bulk MiB at the end |")
print("|---|---|---|---|---|---|---|")
for name in ("alone", "uncapped", "capped"):
    r = runs[name]
    print(f"| {name} | {r['hit_ratio']:.4f} | {r['hit_ratio'] / base:.3f} | {r['wall_s']:.1f} | "
          f"{r['bytes_put_total'] / 2**30:.1f} GiB | {r['app_bytes_end'] / 2**20:.0f} | "
          f"{r['bulk_bytes_end'] / 2**20:.0f} |")
EOF
