#!/usr/bin/env bash
# The fault tests at full length: proximad killed with SIGKILL mid-batch, clients killed
# mid-put and mid-get, corrupt tier memory, and a 60-second flood of puts far beyond capacity
# (the test suite runs the flood for 15 s). Prints the flood's figures (offered load, RSS).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install-deps.sh
PROXIMA_TARGETS="integration_test corruption_test proximad proximactl" ./scripts/build.sh build
PROXIMA_FLOOD_SECONDS=${PROXIMA_FLOOD_SECONDS:-60} \
  ./build/tests/integration/integration_test --gtest_filter='FaultTest.*'
./build/tests/integration/corruption_test
