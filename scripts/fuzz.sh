#!/usr/bin/env bash
# Builds a libFuzzer target with clang (-fsanitize=fuzzer,address,undefined) in its own build
# directory and runs it for a bounded time over the checked-in corpus. Exits non-zero when the
# fuzzer finds a crash, a sanitizer report or a leak; the reproducer lands in the build dir.
#
#   scripts/fuzz.sh codec_decode 30
#   scripts/fuzz.sh request 30        # KVTier requests handled in process by the daemon's code
#   scripts/fuzz.sh config_parse 30   # proximad's YAML config and --set overrides
#   scripts/fuzz.sh peer 30           # proxima.v1.Peer calls from another daemon, in process
#
# Env: PROXIMA_FUZZ_BUILD_DIR (default build-fuzz/ in the repo), CXX_FUZZ (default clang++).
# The build compiles only the sources the target needs (no CMake configure), incrementally.
set -euo pipefail

if [[ $# -ne 2 ]]; then
  echo "usage: $0 TARGET SECONDS   (targets: codec_decode, request, config_parse, peer)" >&2
  exit 2
fi
target=$1
seconds=$2
root=$(cd "$(dirname "$0")/.." && pwd)
out=${PROXIMA_FUZZ_BUILD_DIR:-$root/build-fuzz}
cxx=${CXX_FUZZ:-clang++}

# The codec's CPU sources (kernels/CMakeLists.txt, PROXIMA_CODEC_CPU_SOURCES, minus the KV dump
# reader): the decoder fuzzed directly, and linked by the daemon code (config names codecs, the
# tierer encodes, Get decodes).
codec=(common/crc32c.cc kernels/codec.cc kernels/error_metrics.cc kernels/internal/segment_codecs.cc
       kernels/internal/lossless.cc kernels/internal/cpu_features.cc kernels/internal/simd_avx2.cc
       kernels/internal/simd_avx512.cc)

# The daemon's sources (daemon/CMakeLists.txt) without the server wiring, with the CPU-only
# device code (this build has no CUDA) and the UCX worker the UCX calls link.
daemon=(kernels/device_cpu.cc kernels/codec_cuda_stub.cc common/log.cc common/credentials.cc
        common/ucx.cc proto/wire.cc daemon/config.cc daemon/metrics.cc daemon/extent_map.cc
        daemon/host_tier.cc daemon/device_pool.cc daemon/block_store.cc
        daemon/tier_service.cc daemon/tierer.cc daemon/grpc_service.cc daemon/ucx_transport.cc
        gen/proxima/v1/kvtier.pb.cc gen/proxima/v1/kvtier.grpc.pb.cc)
daemon_libs="grpc++ protobuf yaml-cpp openssl ucx absl_status absl_statusor absl_strings
             absl_str_format absl_raw_hash_set absl_hash absl_time absl_synchronization"

case "$target" in
  codec_decode)
    sources=("${codec[@]}")
    harness=tests/fuzz/codec_decode_fuzzer.cc
    libs="absl_status absl_statusor absl_strings absl_str_format"
    ;;
  config_parse)
    sources=(daemon/config.cc "${codec[@]}")
    harness=tests/fuzz/config_parse_fuzzer.cc
    libs="yaml-cpp absl_status absl_statusor absl_strings absl_str_format absl_raw_hash_set absl_hash
          absl_time"
    ;;
  request)
    sources=("${codec[@]}" "${daemon[@]}")
    harness=tests/fuzz/request_fuzzer.cc
    libs=$daemon_libs
    ;;
  peer)
    # The daemon's sources, and the cluster's peer side: the service, its location records and
    # its UCX half (linked; this harness runs it without a worker).
    sources=("${codec[@]}" "${daemon[@]}" daemon/cluster/peer_service.cc
             daemon/cluster/location_table.cc daemon/cluster/peer_ucx.cc
             daemon/cluster/receive_pool.cc gen/proxima/v1/peer.pb.cc gen/proxima/v1/peer.grpc.pb.cc)
    harness=tests/fuzz/peer_fuzzer.cc
    libs=$daemon_libs
    ;;
  *)
    echo "unknown fuzz target '$target' (known: codec_decode, request, config_parse, peer)" >&2
    exit 2
    ;;
esac

# Generated protobuf/gRPC code, for the targets that handle API messages.
gen=$out/gen
if [[ $target == request || $target == peer ]]; then
  for proto in kvtier peer; do
    if [[ ! -f $gen/proxima/v1/$proto.pb.cc || $root/proto/proxima/v1/$proto.proto -nt $gen/proxima/v1/$proto.pb.cc ]]; then
      mkdir -p "$gen"
      protoc --proto_path="$root/proto" --cpp_out="$gen" --grpc_out="$gen" \
        --plugin=protoc-gen-grpc="$(command -v grpc_cpp_plugin)" "$root/proto/proxima/v1/$proto.proto"
    fi
  done
fi

mkdir -p "$out/obj" "$out/corpus-$target"
flags=(-std=c++20 -O1 -g -fno-omit-frame-pointer -ffp-contract=off -I"$root" -I"$gen"
       -DPROXIMA_VERSION='"fuzz"'
       -fsanitize=fuzzer-no-link,address,undefined -fno-sanitize-recover=undefined)

compile() {  # src -> obj, only when the source or a header is newer
  local src=$1 obj=$2
  local extra=()
  # The SIMD files' ISA flags, as kernels/CMakeLists.txt sets them.
  [[ $src == *simd_avx2.cc ]] && extra=(-mavx2 -mf16c)
  [[ $src == *simd_avx512.cc ]] && extra=(-mavx512f -mavx512bw -mavx512vl -mavx2 -mf16c)
  local path=$root/$src
  [[ $src == gen/* ]] && path=$out/$src && extra+=(-w)
  if [[ ! -f $obj || -n $(find "$root/kernels" "$root/common" "$root/tests/fuzz" "$root/daemon" \
        "$root/proto" -newer "$obj" -name '*.h' -print -quit) || $path -nt $obj ]]; then
    "$cxx" "${flags[@]}" "${extra[@]}" -c "$path" -o "$obj"
  fi
}

pids=()
objs=()
for src in "${sources[@]}" "$harness"; do
  obj="$out/obj/$(echo "$src" | tr / _).o"
  objs+=("$obj")
  compile "$src" "$obj" &
  pids+=($!)
  if (( ${#pids[@]} >= 2 )); then wait "${pids[0]}"; pids=("${pids[@]:1}"); fi
done
for p in "${pids[@]}"; do wait "$p"; done

bin="$out/${target}_fuzzer"
# shellcheck disable=SC2046
"$cxx" -fsanitize=fuzzer,address,undefined "${objs[@]}" -o "$bin" $(pkg-config --libs $libs)

# New inputs go to the scratch corpus (first dir); the checked-in corpus is only read.
echo "fuzzing $target for ${seconds}s"
"$bin" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -max_len=262144 \
  -print_final_stats=1 -artifact_prefix="$out/" \
  "$out/corpus-$target" "$root/tests/fuzz/corpus/$target"
