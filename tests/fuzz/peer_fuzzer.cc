// libFuzzer target `peer`: hostile proxima.v1.Peer requests (method, wire bytes), as another
// daemon of the cluster would send them, handled in process by this daemon's PeerService. Built
// and run by scripts/fuzz.sh peer SECONDS; corpus in tests/fuzz/corpus/peer.
#include <google/protobuf/stubs/logging.h>

#include <cstddef>
#include <cstdint>

#include "common/log.h"
#include "tests/fuzz/peer_fuzz_body.h"

// Quiet, as the request target: protobuf's UTF-8 complaints and the daemon's info lines.
extern "C" int LLVMFuzzerInitialize(int*, char***) {
  google::protobuf::SetLogHandler(nullptr);
  proxima::log::SetMinLevel(proxima::log::Level::kError);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  proxima::daemon::fuzz::RunPeerInput(data, size);
  return 0;
}
