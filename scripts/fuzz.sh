#!/usr/bin/env bash
# Builds a libFuzzer target with clang (-fsanitize=fuzzer,address,undefined) in its own build
# directory and runs it for a bounded time over the checked-in corpus. Exits non-zero when the
# fuzzer finds a crash, a sanitizer report or a leak; the reproducer lands in the build dir.
#
#   scripts/fuzz.sh codec_decode 30
#
# Env: PROXIMA_FUZZ_BUILD_DIR (default build-fuzz/ in the repo), CXX_FUZZ (default clang++).
# The build compiles only the sources the target needs (no CMake configure), incrementally.
set -euo pipefail

if [[ $# -ne 2 ]]; then
  echo "usage: $0 TARGET SECONDS   (targets: codec_decode)" >&2
  exit 2
fi
target=$1
seconds=$2
root=$(cd "$(dirname "$0")/.." && pwd)
out=${PROXIMA_FUZZ_BUILD_DIR:-$root/build-fuzz}
cxx=${CXX_FUZZ:-clang++}

case "$target" in
  codec_decode)
    sources=(common/crc32c.cc kernels/codec.cc kernels/internal/segment_codecs.cc
             kernels/internal/lossless.cc kernels/internal/simd_avx2.cc)
    harness=tests/fuzz/codec_decode_fuzzer.cc
    libs="absl_status absl_statusor absl_strings absl_str_format"
    ;;
  *)
    echo "unknown fuzz target '$target' (known: codec_decode)" >&2
    exit 2
    ;;
esac

mkdir -p "$out/obj" "$out/corpus-$target"
flags=(-std=c++20 -O1 -g -fno-omit-frame-pointer -ffp-contract=off -I"$root"
       -fsanitize=fuzzer-no-link,address,undefined -fno-sanitize-recover=undefined)

compile() {  # src -> obj, only when the source or a header is newer
  local src=$1 obj=$2
  local extra=()
  [[ $src == *simd_avx2.cc ]] && extra=(-mavx2 -mf16c)
  if [[ ! -f $obj || -n $(find "$root/kernels" "$root/common" "$root/tests/fuzz" -newer "$obj" \
        -name '*.h' -print -quit) || $root/$src -nt $obj ]]; then
    "$cxx" "${flags[@]}" "${extra[@]}" -c "$root/$src" -o "$obj"
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
