#!/usr/bin/env bash
# The soak test: a real proximad on loopback under mixed put/get/lookup/delete from many clients
# for 10 minutes (bounded in time and requests), one JSON line per 10 s interval (throughput,
# p50/p99 latency, daemon RSS, errors, wrong bytes) and a summary with the verdict. Exits
# non-zero on any error, any wrong byte, or RSS growth after warm-up.
#   scripts/soak.sh [extra proxima_soak flags, e.g. --duration_s=120 --clients=16]
# Output is also saved to soak.jsonl in the current directory.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
"$ROOT/scripts/install-deps.sh"
cd "$ROOT"
PROXIMA_TARGETS="proxima_soak proximad" ./scripts/build.sh build
cd - >/dev/null
"$ROOT/build/tests/soak/proxima_soak" --duration_s=600 --clients=8 --report_s=10 --warmup_s=60 \
  --max_requests=50000000 "$@" | tee soak.jsonl
