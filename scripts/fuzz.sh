#!/usr/bin/env bash
# Builds a libFuzzer harness of tests/fuzz and runs it for a bounded time over the checked-in
# corpus. Exits non-zero when the fuzzer finds a crash, a sanitizer report or a leak; the
# reproducer lands in build-asan/fuzz/.
#
#   scripts/fuzz.sh codec_decode 30
#   scripts/fuzz.sh codec_encode 30   # block values, geometries and plans into the encoders
#   scripts/fuzz.sh request 30        # KVTier requests handled in process by the daemon's code
#   scripts/fuzz.sh config_parse 30   # proximad's YAML config and --set overrides
#   scripts/fuzz.sh peer 30           # proxima.v1.Peer calls from another daemon, in process
#   scripts/fuzz.sh snapshot 30       # snapshot files (warm restart) into snapshot::Load
#
# The harness is a target (NAME_fuzzer) of the ASan + UBSan build in build-asan/, which is built
# with clang and libFuzzer's coverage instrumentation (scripts/sanitize.sh): the harnesses and the
# sanitized unit tests share one build of the libraries, so each harness costs one file and a link.
set -euo pipefail

if [[ $# -ne 2 ]]; then
  echo "usage: $0 TARGET SECONDS   (targets: codec_decode, codec_encode, request, config_parse, peer, snapshot)" >&2
  exit 2
fi
target=$1
seconds=$2
root=$(cd "$(dirname "$0")/.." && pwd)
# The harnesses are tests/fuzz/NAME_fuzzer.cc (tests/fuzz/CMakeLists.txt makes each a target).
if [[ ! -f $root/tests/fuzz/${target}_fuzzer.cc ]]; then
  known=$(cd "$root/tests/fuzz" && ls *_fuzzer.cc | sed 's/_fuzzer[.]cc$//' | paste -sd, - | sed 's/,/, /g')
  echo "unknown fuzz target '$target' (known: $known)" >&2
  exit 2
fi
PROXIMA_TARGETS="${target}_fuzzer" "$root/scripts/sanitize.sh" address build

out=$root/build-asan/fuzz
mkdir -p "$out/corpus-$target"
# New inputs go to the scratch corpus (first dir); the checked-in corpus is only read.
echo "fuzzing $target for ${seconds}s"
# codec_encode's inputs are cycled to fill a block, so longer ones add nothing but time.
max_len=262144
[[ $target == codec_encode ]] && max_len=4096
"$root/build-asan/tests/fuzz/${target}_fuzzer" -max_total_time="$seconds" -timeout=10 \
  -rss_limit_mb=2048 -max_len="$max_len" -print_final_stats=1 -artifact_prefix="$out/" \
  "$out/corpus-$target" "$root/tests/fuzz/corpus/$target"
