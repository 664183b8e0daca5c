#!/usr/bin/env bash
# Runs a named benchmark from a fresh Release build and prints its JSON lines.
#   scripts/bench.sh put_get     proximad inline gRPC vs Redis, 256 KiB and 2 MiB blocks, 4 clients
#   scripts/bench.sh codec       STAR-KV encode/decode vs memcpy, ratios, error on real KV
#   scripts/bench.sh kv_layout   paged-KV gather/scatter (vLLM layouts, CPU path) vs memcpy
#   scripts/bench.sh quality     perplexity/KL/top-1 per codec plan on SmolLM2 (tools/eval; long)
#   scripts/bench.sh security    TLS + mTLS + bearer token vs plaintext without token (proximactl load)
#   scripts/bench.sh replay      Mooncake trace replay: hit ratio per memory budget, raw vs compressed
#   scripts/bench.sh policy      temperature policies (LRU, FIFO, S3-FIFO, ARC) simulated on the trace
#   scripts/bench.sh tierer      blocks held and put rate per compression hierarchy vs raw storage
#   scripts/bench.sh snapshot    warm-restart snapshot write and load vs a plain write and read of
#                                the same bytes on the same disk (--dir, --gib, --drop_caches=1)
#   scripts/bench.sh restart     the Mooncake trace replayed across a SIGTERM restart: hit ratio
#                                after it with the snapshot and without, vs no restart
#   scripts/bench.sh neighbour   the trace replayed in one namespace while another floods the node
#                                with puts: hit ratio alone, with the flood, with it capped (max_bytes)
#   scripts/bench.sh transfer    UCX data plane vs ucx_perftest, inline gRPC, Redis and the bare
#                                move (a TCP stream over tcp, memcpy over shm); tcp and shm
#   scripts/bench.sh sim         cluster placement simulated on the trace, 10 to 1,000 nodes (tools/sim)
#   scripts/bench.sh cluster     2 MiB get served one hop away (daemon to daemon) vs served locally; the hand-off
#                                of a stopped daemon's blocks to its peers vs that one-hop get
#   scripts/bench.sh call_floor  one small call to proximad vs an empty in-process gRPC call and a
#                                thread wake-up (what a call costs below the daemon)
#   scripts/bench.sh connect     a client's first UCX connect with ucx.check_worker_addresses vs
#                                without it (proximactl info --transport=ucx, new worker each run)
# Extra arguments go to the benchmark binary.
set -euo pipefail
cd "$(dirname "$0")/.."
NAME=${1:?usage: scripts/bench.sh NAME [args...] (NAME: put_get | codec | kv_layout | quality | security | replay | policy | tierer | snapshot | restart | neighbour | transfer | sim | cluster | call_floor | connect)}
shift
./scripts/install-deps.sh >/dev/null
case "$NAME" in
  put_get) export PROXIMA_TARGETS="proximad put_get_bench" ;;
  codec) export PROXIMA_TARGETS="codec_bench" ;;
  kv_layout) export PROXIMA_TARGETS="kv_layout_bench" ;;
  security) export PROXIMA_TARGETS="proximad proximactl" ;;
  replay | restart) export PROXIMA_TARGETS="proximad proxima_replay" ;;
  neighbour) export PROXIMA_TARGETS="proximad proxima_replay proximactl" ;;
  policy) export PROXIMA_TARGETS="proxima_replay" ;;
  tierer) export PROXIMA_TARGETS="tierer_bench" ;;
  snapshot) export PROXIMA_TARGETS="snapshot_bench" ;;
  transfer) export PROXIMA_TARGETS="proximad transfer_bench" ;;
  sim) export PROXIMA_TARGETS="proxima_placement_sim" ;;
  cluster) export PROXIMA_TARGETS="proximad proximactl" ;;
  call_floor) export PROXIMA_TARGETS="proximad call_floor_bench" ;;
  connect) export PROXIMA_TARGETS="proximad proximactl" ;;
  *) export PROXIMA_TARGETS="" ;;
esac
./scripts/build.sh build-bench -DCMAKE_BUILD_TYPE=Release -DPROXIMA_BUILD_TESTS=OFF \
  -DPROXIMA_BUILD_BENCH=ON >/dev/null
echo "# $(date -u +%FT%TZ) $(lscpu | sed -n 's/^Model name: *//p') ($(nproc) CPUs)" >&2
case "$NAME" in
  put_get) exec ./build-bench/bench/put_get_bench "$@" ;;
  codec) exec ./scripts/bench-codec.sh \
           --kv_file=tools/eval/testdata/smollm2-135m_gpl3_t0-256_bf16.pkv --working_set_mb=64 "$@" ;;
  kv_layout) exec ./build-bench/bench/kv_layout_bench "$@" ;;
  quality) exec ./scripts/bench-quality.sh "$@" ;;
  security) exec python3 bench/security_bench.py --proximad=build-bench/daemon/proximad \
              --proximactl=build-bench/tools/proximactl/proximactl "$@" ;;
  replay) exec ./scripts/bench-replay.sh "$@" ;;
  restart) exec ./scripts/bench-restart.sh "$@" ;;
  neighbour) exec ./scripts/bench-neighbour.sh "$@" ;;
  # The whole trace (no sampling: S3-FIFO's small queue and ARC's ghosts see the interleaving of
  # all conversations), sizes from 1% to 35% of its 182,790 distinct blocks.
  policy) exec ./build-bench/tools/replay/proxima_replay \
            --trace=../shared/data/mooncake_conversation_trace.jsonl --sample_one_in=1 \
            --simulate=lru,fifo,s3fifo,arc,slru,slru:0.1,slru:0.3,slru:0.5 --capacities=2000,4000,8000,16000,32000,64000 "$@" ;;
  tierer) exec ./build-bench/bench/tierer_bench \
            --kv_file=tools/eval/testdata/smollm2-135m_gpl3_t0-256_bf16.pkv "$@" ;;
  transfer) exec ./build-bench/bench/transfer_bench "$@" ;;
  snapshot) exec ./build-bench/bench/snapshot_bench "$@" ;;
  # The whole trace (182,790 distinct blocks) at 10, 30, 100, 300 and 1,000 nodes.
  sim) exec ./build-bench/tools/sim/proxima_placement_sim \
         --trace=../shared/data/mooncake_conversation_trace.jsonl "$@" ;;
  cluster) exec python3 bench/cluster_bench.py --proximad=build-bench/daemon/proximad \
             --proximactl=build-bench/tools/proximactl/proximactl "$@" ;;
  call_floor) exec ./build-bench/bench/call_floor_bench "$@" ;;
  connect) exec python3 bench/connect_bench.py --proximad=build-bench/daemon/proximad \
    --proximactl=build-bench/tools/proximactl/proximactl "$@" ;;
  *) echo "unknown benchmark '$NAME' (known: put_get, codec, kv_layout, quality, security, replay, policy, tierer, snapshot, restart, neighbour, transfer, sim, cluster, call_floor)" >&2
     exit 2 ;;
esac
