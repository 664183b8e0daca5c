// BufferCache: byte buffers of a few recurring sizes (a profile's raw block size), handed out as
// shared_ptr and kept for reuse when their last owner lets go, up to a cap on the bytes kept.
//
// Why: a Get of compressed blocks decodes each into a buffer of its own that the response then
// references until gRPC or UCX has sent it. Buffers of hundreds of KiB come straight from the
// allocator's page runs, and jemalloc gives freed runs back to the kernel within milliseconds
// under this pattern (its decay purge), so every Get faulted in and zero-filled all its pages
// again: half of an int4 Get's time on one thread (docs/benchmarks.md, "A Get of compressed
// blocks"). Reused buffers are already mapped.
//
// Buffers are not zero-filled (the decoder writes every byte of a buffer it succeeds on).
// A buffer returned while the cache holds `max_bytes` makes room by freeing buffers of other
// sizes (a profile no longer read), or is freed itself. Buffers outlive the cache safely.
//
// Thread-safe.
#ifndef PROXIMA_DAEMON_BUFFER_CACHE_H_
#define PROXIMA_DAEMON_BUFFER_CACHE_H_

#include <cstddef>
#include <cstdint>
#include <memory>

namespace proxima::daemon {

class BufferCache {
 public:
  // `max_bytes` 0: nothing is kept (every buffer is allocated and freed).
  explicit BufferCache(uint64_t max_bytes);
  ~BufferCache();
  BufferCache(const BufferCache&) = delete;
  BufferCache& operator=(const BufferCache&) = delete;

  // A buffer of `bytes` bytes (REQUIRES: bytes > 0), contents unspecified: a kept one of that
  // size when there is one, else a new one.
  std::shared_ptr<std::byte[]> Take(size_t bytes);

  // Bytes of the buffers kept now, and how many Takes found one kept / allocated one.
  uint64_t kept_bytes() const;
  uint64_t reused() const;
  uint64_t allocated() const;

 private:
  struct State;
  // Shared with every buffer handed out, whose deleter gives the buffer back to it.
  std::shared_ptr<State> state_;
};

}  // namespace proxima::daemon

#endif  // PROXIMA_DAEMON_BUFFER_CACHE_H_
