// proxima._proxima: the Python binding of libproxima (client/client.h), torch-free.
//
// Memory is named by plain integers: a block is a scatter/gather list of (address, length)
// pieces whose lengths add up to the profile's block size, so one block may span many buffers
// (one piece per layer, or a K and a V piece). Every piece must lie inside a buffer registered
// with register_buffer(): an address outside every registered buffer is a ValueError naming it,
// never a wild read or write. Blocks go to Client::PutScattered / GetScattered: over UCX the
// daemon reads and writes the pieces in place, inline a multi-piece block takes one gather (or
// scatter) copy, and pieces in GPU memory go through the client's pinned staging buffers.
//
// register_buffer also registers the buffer with UCX once (Client::RegisterMemory), so calls on
// blocks inside it register nothing; alloc_buffer gives a Buffer of memory UCX allocated
// (Client::AllocateMemory), which over shared memory the daemon copies into and out of directly.
//
// Every call releases the GIL while it talks to the daemon. The *_async variants run on the
// client's worker threads and return a Handle (poll() / wait()); the buffers they name must stay
// registered and alive until the handle completes.
//
// Errors: a non-OK absl::Status becomes ValueError (INVALID_ARGUMENT), proxima.Unavailable
// (UNAVAILABLE, DEADLINE_EXCEEDED: no daemon, or it did not answer in time) or proxima.Error
// (anything else), with the status' message, which names the key, value and expectation.
//
// KvLayout (kernels/kv_layout.h): the paged KV tensors of an engine, described by addresses and
// element strides, and gather/scatter of whole blocks between them and canonical blocks
// [layer][k|v][token][head][dim], on the CPU or (device=True) with the CUDA kernel.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <variant>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "client/client.h"
#include "common/status_macros.h"
#include "kernels/device.h"
#include "kernels/kv_layout.h"

namespace py = pybind11;

namespace proxima::client {
namespace {

PyObject* g_error = nullptr;        // proxima.Error (RuntimeError)
PyObject* g_unavailable = nullptr;  // proxima.Unavailable (proxima.Error, ConnectionError)
unsigned long g_main_thread = 0;    // threading.main_thread().ident: where Python finalizes

// Releases the GIL for its scope (what py::gil_scoped_release does), and is safe on a thread
// that comes back while the interpreter is exiting. Python stops such a thread inside
// PyEval_RestoreThread with pthread_exit, whose unwinding out of a destructor (noexcept) is
// std::terminate: a process that ran a call on a daemon thread could abort at exit ("terminate
// called without an active exception"). Such a thread waits here instead, as Python 3.14's own
// threads do, until the process ends. (A thread that finds the interpreter exiting only between
// the check and the restore still takes Python's way out; noexcept(false) lets that unwind
// leave the calls that are not destructors.)
class GilReleased {
 public:
  GilReleased() : state_(PyEval_SaveThread()) {}
  ~GilReleased() noexcept(false) {
    if (Finalizing() && PyThread_get_thread_ident() != g_main_thread) {
      while (true) std::this_thread::sleep_for(std::chrono::hours(1));
    }
    PyEval_RestoreThread(state_);
  }
  GilReleased(const GilReleased&) = delete;
  GilReleased& operator=(const GilReleased&) = delete;

 private:
  static bool Finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
    return Py_IsFinalizing() != 0;
#else
    return _Py_IsFinalizing() != 0;
#endif
  }
  PyThreadState* state_;
};

[[noreturn]] void Throw(const absl::Status& status) {
  const std::string what(status.ToString());
  if (status.code() == absl::StatusCode::kInvalidArgument) throw py::value_error(what);
  PyObject* type = (status.code() == absl::StatusCode::kUnavailable ||
                    status.code() == absl::StatusCode::kDeadlineExceeded)
                       ? g_unavailable
                       : g_error;
  PyErr_SetString(type, what.c_str());
  throw py::error_already_set();
}

template <typename T>
T ValueOrThrow(absl::StatusOr<T> value) {
  if (!value.ok()) Throw(value.status());
  return *std::move(value);
}

struct Piece {
  uintptr_t address = 0;
  size_t length = 0;
};
using Block = std::vector<Piece>;

// The (address, length) ranges the caller promised are valid memory, by start address, each with
// its UCX registration (Client::RegisterMemory; an empty handle over inline). Buffers from
// alloc_buffer are entries too, marked owned: their Buffer object holds the region.
class BufferRegistry {
 public:
  // Reserves [address, address + length) for `caller` (named in the ValueError on a null address,
  // a zero length or an overlap); returns the entry's serial for SetRegion.
  uint64_t Reserve(const std::string& caller, uintptr_t address, size_t length, bool owned) {
    if (address == 0 || length == 0) {
      throw py::value_error(absl::StrCat(caller, "(", address, ", ", length,
                                         "): expected a non-null address and a length > 0"));
    }
    std::lock_guard<std::mutex> lock(mu_);
    auto next = buffers_.lower_bound(address);
    const bool overlaps_next = next != buffers_.end() && next->first < address + length;
    const bool overlaps_prev = next != buffers_.begin() && [&] {
      auto prev = std::prev(next);
      return prev->first + prev->second.length > address;
    }();
    if (overlaps_next || overlaps_prev) {
      throw py::value_error(absl::StrCat(caller, "(", address, ", ", length,
                                         "): overlaps a buffer already registered"));
    }
    Entry& e = buffers_[address];
    e.length = length;
    e.owned = owned;
    e.serial = ++serial_;
    return e.serial;
  }
  // Gives the entry reserved as `serial` its region; returns the region back when that entry
  // is gone (unregistered meanwhile), for the caller to drop.
  MemoryRegion SetRegion(uintptr_t address, uint64_t serial, MemoryRegion region) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = buffers_.find(address);
    if (it == buffers_.end() || it->second.serial != serial) return region;
    it->second.region = std::move(region);
    return MemoryRegion();
  }
  // Removes the buffer at `address` and hands back its region (to drop without the lock, and
  // without the GIL: deregistration waits for the UCX thread). nullopt when none is there.
  // ValueError for an alloc_buffer's memory unless `owned` (its Buffer's close()).
  std::optional<MemoryRegion> Remove(uintptr_t address, bool owned) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = buffers_.find(address);
    if (it == buffers_.end()) return std::nullopt;
    if (it->second.owned && !owned) {
      throw py::value_error(absl::StrCat("unregister_buffer(", address,
                                         "): the memory of an alloc_buffer; close the buffer "
                                         "instead"));
    }
    MemoryRegion region = std::move(it->second.region);
    buffers_.erase(it);
    return region;
  }
  // ValueError unless [address, address + length) lies inside one registered buffer.
  void Check(const Piece& piece, size_t block, size_t index) const {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = buffers_.upper_bound(piece.address);
    if (it != buffers_.begin()) {
      --it;
      const size_t length = it->second.length;
      if (piece.address >= it->first && piece.length <= length &&
          piece.address - it->first <= length - piece.length) {
        return;
      }
    }
    throw py::value_error(absl::StrCat("block ", block, " piece ", index, " (address ",
                                       piece.address, ", length ", piece.length,
                                       "): expected it inside a registered buffer"));
  }
  size_t size() const {
    std::lock_guard<std::mutex> lock(mu_);
    return buffers_.size();
  }

 private:
  struct Entry {
    size_t length = 0;
    bool owned = false;
    uint64_t serial = 0;
    MemoryRegion region;
  };
  mutable std::mutex mu_;
  uint64_t serial_ = 0;
  std::map<uintptr_t, Entry> buffers_;
};

// The Client and the buffers registered with it, shared by the PyClient, its calls in flight and
// the Buffers it allocated: whichever goes last destroys it, dropping every registration before
// the Client (MemoryRegions must not outlive it; members are destroyed in reverse order).
struct Session {
  std::unique_ptr<Client> client;
  BufferRegistry registry;
};

std::vector<BlockKey> ParseKeys(const std::vector<py::bytes>& keys) {
  std::vector<BlockKey> out(keys.size());
  for (size_t i = 0; i < keys.size(); ++i) {
    std::string_view key = keys[i];
    if (key.size() != kKeyBytes) {
      throw py::value_error(
          absl::StrCat("key ", i, " is ", key.size(), " bytes; expected ", kKeyBytes));
    }
    std::memcpy(out[i].data(), key.data(), kKeyBytes);
  }
  return out;
}

// Blocks as lists of (address, length) pairs, each checked against the registry and summing to
// the profile's block size.
std::vector<Block> ParseBlocks(const std::vector<std::vector<std::pair<uintptr_t, size_t>>>& in,
                               size_t num_keys, const Profile& profile,
                               const BufferRegistry& registry) {
  if (in.size() != num_keys) {
    throw py::value_error(
        absl::StrCat(in.size(), " blocks for ", num_keys, " keys; expected one block per key"));
  }
  std::vector<Block> out(in.size());
  for (size_t b = 0; b < in.size(); ++b) {
    size_t total = 0;
    for (size_t p = 0; p < in[b].size(); ++p) {
      Piece piece{in[b][p].first, in[b][p].second};
      registry.Check(piece, b, p);
      total += piece.length;
      out[b].push_back(piece);
    }
    if (total != profile.block_bytes) {
      throw py::value_error(absl::StrCat("block ", b, " spans ", total,
                                         " bytes; expected the profile's block size ",
                                         profile.block_bytes));
    }
  }
  return out;
}

// The results of the calls, kept as C++ values until the caller (holding the GIL) collects them.
using Result = std::variant<std::vector<PutOutcome>, std::vector<bool>, size_t>;

// What a put carries besides the bytes (client::PutOptions), owned by the call.
struct PutHints {
  std::vector<int64_t> positions;
  std::vector<float> importance;
  bool high_priority = false;
};

absl::StatusOr<Result> DoPut(Client& client, const Profile& profile,
                             const std::vector<BlockKey>& keys, const std::vector<Block>& blocks,
                             const PutHints& hints) {
  std::vector<client::ConstSegments> segments(blocks.size());
  for (size_t b = 0; b < blocks.size(); ++b) {
    for (const Piece& p : blocks[b]) {
      segments[b].emplace_back(reinterpret_cast<const std::byte*>(p.address), p.length);
    }
  }
  client::PutOptions options;
  options.positions = hints.positions;
  options.importance = hints.importance;
  options.high_priority = hints.high_priority;
  PROXIMA_ASSIGN_OR_RETURN(auto outcomes, client.PutScattered(profile, keys, segments, options));
  return Result(std::move(outcomes));
}

absl::StatusOr<Result> DoGet(Client& client, const Profile& profile,
                             const std::vector<BlockKey>& keys, const std::vector<Block>& blocks) {
  std::vector<client::Segments> segments(blocks.size());
  for (size_t b = 0; b < blocks.size(); ++b) {
    for (const Piece& p : blocks[b]) {
      segments[b].emplace_back(reinterpret_cast<std::byte*>(p.address), p.length);
    }
  }
  PROXIMA_ASSIGN_OR_RETURN(std::vector<bool> found, client.GetScattered(profile, keys, segments));
  return Result(std::move(found));
}

absl::StatusOr<Result> DoLookup(Client& client, const Profile& profile,
                                const std::vector<BlockKey>& keys) {
  PROXIMA_ASSIGN_OR_RETURN(size_t n, client.Lookup(profile, keys));
  return Result(n);
}

// Presence of every key, through Lookup: each call answers how many keys from `start` are
// present, so a batch costs one call per missing key plus one.
absl::StatusOr<Result> DoExists(Client& client, const Profile& profile,
                                const std::vector<BlockKey>& keys) {
  std::vector<bool> present(keys.size(), false);
  size_t start = 0;
  while (start < keys.size()) {
    PROXIMA_ASSIGN_OR_RETURN(
        size_t n, client.Lookup(profile, std::span<const BlockKey>(keys).subspan(start)));
    for (size_t i = start; i < start + n; ++i) present[i] = true;
    start += n + 1;  // keys[start + n] is missing
  }
  return Result(std::move(present));
}

absl::StatusOr<Result> DoDelete(Client& client, const Profile& profile,
                                const std::vector<BlockKey>& keys) {
  PROXIMA_ASSIGN_OR_RETURN(size_t n, client.Delete(profile, keys));
  return Result(n);
}

py::object ToPython(const Result& result) {
  if (const auto* outcomes = std::get_if<std::vector<PutOutcome>>(&result)) {
    py::list out;
    for (PutOutcome o : *outcomes) {
      out.append(o == PutOutcome::kStored           ? "stored"
                 : o == PutOutcome::kAlreadyPresent ? "already_present"
                                                    : "no_space");
    }
    return out;
  }
  if (const auto* flags = std::get_if<std::vector<bool>>(&result)) return py::cast(*flags);
  return py::int_(std::get<size_t>(result));
}

// One asynchronous call: completed once by a worker, read by poll()/wait().
class Operation {
 public:
  void Complete(absl::StatusOr<Result> result) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      result_ = std::move(result);
    }
    cv_.notify_all();
  }
  bool done() const {
    std::lock_guard<std::mutex> lock(mu_);
    return result_.has_value();
  }
  // Waits (GIL released) up to `timeout` seconds (forever when None, inf, or any wait longer
  // than kForeverSeconds; a negative one does not wait); returns the call's value or raises its
  // error; TimeoutError when it has not completed in time, ValueError for a NaN timeout.
  py::object Wait(std::optional<double> timeout) {
    // Past about 292 years a wait's nanoseconds overflow, and the wait returned at once.
    constexpr double kForeverSeconds = 1e9;
    if (timeout.has_value() && std::isnan(*timeout)) {
      throw py::value_error("wait(timeout=nan): expected seconds (a number) or None");
    }
    if (timeout.has_value() && *timeout >= kForeverSeconds) timeout.reset();
    {
      GilReleased release;
      std::unique_lock<std::mutex> lock(mu_);
      auto ready = [&] { return result_.has_value(); };
      if (timeout.has_value()) {
        cv_.wait_for(lock, std::chrono::duration<double>(std::max(*timeout, 0.0)), ready);
      } else {
        cv_.wait(lock, ready);
      }
    }
    std::lock_guard<std::mutex> lock(mu_);
    if (!result_.has_value()) {
      PyErr_SetString(PyExc_TimeoutError, "proxima operation still running after the timeout");
      throw py::error_already_set();
    }
    if (!result_->ok()) Throw(result_->status());
    return ToPython(**result_);
  }

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::optional<absl::StatusOr<Result>> result_;
};

// A fixed set of threads running queued calls in order of submission.
class Workers {
 public:
  explicit Workers(size_t n) {
    for (size_t i = 0; i < n; ++i) threads_.emplace_back([this] { Run(); });
  }
  ~Workers() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
    }
    cv_.notify_all();
    for (std::thread& t : threads_) t.join();
  }
  void Submit(std::function<void()> task) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.push_back(std::move(task));
    }
    cv_.notify_one();
  }

 private:
  void Run() {
    while (true) {
      std::function<void()> task;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stopping, and everything queued has run
        task = std::move(queue_.front());
        queue_.pop_front();
      }
      task();
    }
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  bool stopping_ = false;
  std::vector<std::thread> threads_;
};

using PieceLists = std::vector<std::vector<std::pair<uintptr_t, size_t>>>;

// proxima.Buffer (Client.alloc_buffer): memory from Client::AllocateMemory, registered with its
// client's registry. It holds the Session, so its Client outlives it. It exposes the buffer
// protocol (memoryview, numpy.frombuffer, torch.frombuffer: no copy); close(), or the end of
// the object, unregisters and frees the memory. close() is refused (BufferError, as mmap does)
// while a view made through the buffer protocol is alive; torch.frombuffer releases its view
// at once (it keeps the object alive instead), so a tensor made by it must not be used after
// an explicit close(). A call in flight over UCX keeps the memory until it ends.
class PyBuffer {
 public:
  PyBuffer(std::shared_ptr<Session> session, MemoryRegion region)
      : session_(std::move(session)), region_(std::move(region)), length_(region_.bytes().size()) {}
  ~PyBuffer() {
    Parts parts = Take();
    GilReleased release;  // deregistration waits for the UCX thread
    parts.Drop();
  }
  PyBuffer(const PyBuffer&) = delete;
  PyBuffer& operator=(const PyBuffer&) = delete;

  bool closed() const { return session_ == nullptr; }
  size_t length() const { return length_; }
  uintptr_t address() const { return reinterpret_cast<uintptr_t>(Data("address")); }

  void Close() {
    if (exports_ > 0) {
      PyErr_SetString(PyExc_BufferError,
                      absl::StrCat("proxima.Buffer.close(): ", exports_,
                                   " view(s) of the buffer (memoryview, numpy array) still "
                                   "exist; release them first")
                          .c_str());
      throw py::error_already_set();
    }
    Parts parts = Take();
    GilReleased release;
    parts.Drop();
  }

  // The buffer protocol (installed on the type by custom_type_setup): one writable dimension of
  // unsigned bytes; counts the views so that close() can refuse while any is alive.
  static int GetBuffer(PyObject* self, Py_buffer* view, int flags) {
    view->obj = nullptr;
    PyBuffer* b = nullptr;
    try {
      // Buffer.__new__ alone makes an instance whose C++ object was never constructed.
      auto* inst = reinterpret_cast<py::detail::instance*>(self);
      if (!inst->get_value_and_holder().holder_constructed()) {
        throw py::value_error("proxima.Buffer: not made by Client.alloc_buffer");
      }
      b = py::handle(self).cast<PyBuffer*>();
      if (b->closed()) b->Data("buffer protocol");  // throws the closed error
    } catch (py::error_already_set& e) {
      e.restore();
      return -1;
    } catch (const std::exception& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
      return -1;
    }
    if (PyBuffer_FillInfo(view, self, b->region_.bytes().data(),
                          static_cast<Py_ssize_t>(b->length_), /*readonly=*/0, flags) != 0) {
      return -1;
    }
    ++b->exports_;
    return 0;
  }
  static void ReleaseBuffer(PyObject* self, Py_buffer*) {
    --py::handle(self).cast<PyBuffer*>()->exports_;
  }

 private:
  // What close() drops, taken out with the GIL held and dropped without it.
  struct Parts {
    uintptr_t address = 0;
    std::shared_ptr<Session> session;
    MemoryRegion region;
    void Drop() {
      if (session == nullptr) return;
      session->registry.Remove(address, /*owned=*/true);  // its entry holds no region
      region = MemoryRegion();                            // before the session (its Client)
      session.reset();
    }
  };
  Parts Take() {
    if (closed()) return {};
    Parts parts{reinterpret_cast<uintptr_t>(region_.bytes().data()), std::move(session_),
                std::move(region_)};
    session_.reset();
    region_ = MemoryRegion();
    return parts;
  }
  std::byte* Data(const char* what) const {
    if (closed()) {
      throw py::value_error(absl::StrCat("proxima.Buffer (", length_, " bytes) is closed; ", what,
                                         " of a closed buffer"));
    }
    return region_.bytes().data();
  }

  std::shared_ptr<Session> session_;  // null once closed
  MemoryRegion region_;
  const size_t length_;
  int exports_ = 0;  // views alive (the GIL guards it)
};

class PyClient {
 public:
  PyClient(ClientOptions options, size_t async_threads) {
    if (async_threads == 0) throw py::value_error("async_threads is 0; expected at least 1");
    absl::StatusOr<std::unique_ptr<Client>> client;
    {
      GilReleased release;
      client = Client::Connect(options);
    }
    session_ = std::make_shared<Session>();
    session_->client = ValueOrThrow(std::move(client));
    workers_ = std::make_unique<Workers>(async_threads);
  }
  ~PyClient() {
    GilReleased release;  // queued calls finish without needing the GIL
    workers_.reset();
    session_.reset();  // the registrations, then the Client, unless a Buffer still holds them
  }

  Profile RegisterProfile(uint32_t num_layers, uint32_t num_kv_heads, uint32_t head_dim,
                          uint32_t tokens_per_block, const std::string& dtype,
                          const std::string& fingerprint, double rope_theta) {
    v1::ModelProfile model;
    model.set_num_layers(num_layers);
    model.set_num_kv_heads(num_kv_heads);
    model.set_head_dim(head_dim);
    model.set_tokens_per_block(tokens_per_block);
    if (dtype == "fp16" || dtype == "float16") {
      model.set_dtype(v1::DTYPE_FP16);
    } else if (dtype == "bf16" || dtype == "bfloat16") {
      model.set_dtype(v1::DTYPE_BF16);
    } else if (dtype == "fp8_e4m3" || dtype == "float8_e4m3fn") {
      model.set_dtype(v1::DTYPE_FP8_E4M3);
    } else {
      throw py::value_error("dtype '" + dtype +
                            "': expected fp16, bf16 or fp8_e4m3 (or the torch names float16, "
                            "bfloat16, float8_e4m3fn)");
    }
    model.set_fingerprint(fingerprint);
    model.set_rope_theta(rope_theta);  // the daemon checks the range
    absl::StatusOr<Profile> profile;
    {
      GilReleased release;
      profile = session_->client->RegisterProfile(model);
    }
    return ValueOrThrow(std::move(profile));
  }

  // Records the buffer for the bounds checks and registers it with UCX once (Client::
  // RegisterMemory), so that calls on blocks inside it register nothing.
  void RegisterBuffer(uintptr_t address, size_t length) {
    BufferRegistry& registry = session_->registry;
    const uint64_t serial = registry.Reserve("register_buffer", address, length, /*owned=*/false);
    absl::StatusOr<MemoryRegion> region;
    {
      GilReleased release;
      region = session_->client->RegisterMemory(reinterpret_cast<void*>(address), length);
    }
    if (!region.ok()) {
      registry.Remove(address, /*owned=*/false);
      Throw(region.status());
    }
    MemoryRegion stale = registry.SetRegion(address, serial, *std::move(region));
    GilReleased release;
    stale = MemoryRegion();  // unregistered meanwhile by another thread
  }
  // False when no buffer was registered at `address`. A call in flight keeps its registration.
  bool UnregisterBuffer(uintptr_t address) {
    std::optional<MemoryRegion> region = session_->registry.Remove(address, /*owned=*/false);
    if (!region.has_value()) return false;
    GilReleased release;
    region.reset();
    return true;
  }
  std::unique_ptr<PyBuffer> AllocBuffer(size_t length) {
    if (length == 0) throw py::value_error("alloc_buffer(0): expected a length > 0");
    absl::StatusOr<MemoryRegion> allocated;
    {
      GilReleased release;
      allocated = session_->client->AllocateMemory(length);
    }
    MemoryRegion region = ValueOrThrow(std::move(allocated));
    try {
      session_->registry.Reserve("alloc_buffer", reinterpret_cast<uintptr_t>(region.bytes().data()),
                                 length, /*owned=*/true);
    } catch (const py::value_error&) {  // a registered buffer covers memory since freed
      GilReleased release;
      region = MemoryRegion();
      throw;
    }
    return std::make_unique<PyBuffer>(session_, std::move(region));
  }

  py::object Put(const Profile& p, const std::vector<py::bytes>& keys, const PieceLists& blocks,
                 std::vector<int64_t> positions, bool high_priority,
                 std::vector<float> importance) {
    return RunNow(
        PreparePut(p, keys, blocks, {std::move(positions), std::move(importance), high_priority}));
  }
  py::object Get(const Profile& p, const std::vector<py::bytes>& keys, const PieceLists& blocks) {
    return RunNow(Prepare(p, keys, blocks, &DoGet));
  }
  py::object Lookup(const Profile& p, const std::vector<py::bytes>& keys) {
    return RunNow(Prepare(p, keys, &DoLookup));
  }
  py::object Exists(const Profile& p, const std::vector<py::bytes>& keys) {
    return RunNow(Prepare(p, keys, &DoExists));
  }
  py::object Delete(const Profile& p, const std::vector<py::bytes>& keys) {
    return RunNow(Prepare(p, keys, &DoDelete));
  }
  std::shared_ptr<Operation> PutAsync(const Profile& p, const std::vector<py::bytes>& keys,
                                      const PieceLists& blocks, std::vector<int64_t> positions,
                                      bool high_priority, std::vector<float> importance) {
    return Start(
        PreparePut(p, keys, blocks, {std::move(positions), std::move(importance), high_priority}));
  }
  std::shared_ptr<Operation> GetAsync(const Profile& p, const std::vector<py::bytes>& keys,
                                      const PieceLists& blocks) {
    return Start(Prepare(p, keys, blocks, &DoGet));
  }
  std::shared_ptr<Operation> LookupAsync(const Profile& p, const std::vector<py::bytes>& keys) {
    return Start(Prepare(p, keys, &DoLookup));
  }
  std::shared_ptr<Operation> ExistsAsync(const Profile& p, const std::vector<py::bytes>& keys) {
    return Start(Prepare(p, keys, &DoExists));
  }

  std::string StatsJson() {
    absl::StatusOr<std::string> json;
    {
      GilReleased release;
      absl::StatusOr<v1::StatsResponse> stats = session_->client->Stats();
      json = stats.ok() ? StatsToJson(*stats) : absl::StatusOr<std::string>(stats.status());
    }
    return ValueOrThrow(std::move(json));
  }

  py::dict ServerInfoDict() const {
    const ServerInfo& info = session_->client->server_info();
    py::dict d;
    d["version"] = info.version;
    d["max_message_bytes"] = info.max_message_bytes;
    d["max_batch_blocks"] = info.max_batch_blocks;
    d["max_lookup_keys"] = info.max_lookup_keys;
    d["max_inflight_bytes_per_client"] = info.max_inflight_bytes;
    return d;
  }
  uint64_t crc_failures() const { return session_->client->crc_failures(); }
  size_t registered_buffers() const { return session_->registry.size(); }
  std::string transport() const { return TransportName(session_->client->transport()); }
  std::string transport_detail() const { return session_->client->transport_detail(); }

 private:
  using Call = std::function<absl::StatusOr<Result>()>;

  // Decodes the arguments (GIL held) into a call that needs no Python objects.
  Call Prepare(const Profile& p, const std::vector<py::bytes>& keys, const PieceLists& blocks,
               absl::StatusOr<Result> (*fn)(Client&, const Profile&, const std::vector<BlockKey>&,
                                            const std::vector<Block>&)) {
    std::vector<BlockKey> k = ParseKeys(keys);
    std::vector<Block> b = ParseBlocks(blocks, k.size(), p, session_->registry);
    return [session = session_, p, k = std::move(k), b = std::move(b), fn] {
      return fn(*session->client, p, k, b);
    };
  }
  Call PreparePut(const Profile& p, const std::vector<py::bytes>& keys, const PieceLists& blocks,
                  PutHints hints) {
    std::vector<BlockKey> k = ParseKeys(keys);
    std::vector<Block> b = ParseBlocks(blocks, k.size(), p, session_->registry);
    return [session = session_, p, k = std::move(k), b = std::move(b), h = std::move(hints)] {
      return DoPut(*session->client, p, k, b, h);
    };
  }
  Call Prepare(const Profile& p, const std::vector<py::bytes>& keys,
               absl::StatusOr<Result> (*fn)(Client&, const Profile&,
                                            const std::vector<BlockKey>&)) {
    return [session = session_, p, k = ParseKeys(keys), fn] { return fn(*session->client, p, k); };
  }
  py::object RunNow(const Call& call) {
    absl::StatusOr<Result> result;
    {
      GilReleased release;
      result = call();
    }
    return ToPython(ValueOrThrow(std::move(result)));
  }
  std::shared_ptr<Operation> Start(Call call) {
    auto op = std::make_shared<Operation>();
    workers_->Submit([op, call = std::move(call)] { op->Complete(call()); });
    return op;
  }

  std::shared_ptr<Session> session_;
  std::unique_ptr<Workers> workers_;
};

// proxima.KvLayout: validated once at construction; gather/scatter release the GIL.
class PyKvLayout {
 public:
  using LayerTuple = std::tuple<uintptr_t, uintptr_t, size_t, size_t>;
  PyKvLayout(const std::vector<LayerTuple>& layers,
             const std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t>& strides,
             uint64_t num_blocks, uint32_t num_kv_heads, uint32_t head_dim,
             uint32_t tokens_per_block, uint32_t element_size, bool device,
             uint32_t blocks_per_canonical)
      : device_(device) {
    layout_.blocks_per_canonical = blocks_per_canonical;
    layout_.element_size = element_size;
    layout_.num_kv_heads = num_kv_heads;
    layout_.head_dim = head_dim;
    layout_.tokens_per_block = tokens_per_block;
    layout_.num_blocks = num_blocks;
    const auto& [kv, block, token, head, dim] = strides;
    layout_.strides = {kv, block, token, head, dim};
    for (const auto& [k, v, k_size, v_size] : layers) {
      layout_.layers.push_back(
          {reinterpret_cast<std::byte*>(k), reinterpret_cast<std::byte*>(v), k_size, v_size});
    }
    if (absl::Status st = layout_.Validate(); !st.ok()) Throw(st);
  }

  size_t block_bytes() const { return layout_.BlockBytes(); }
  bool device() const { return device_; }

  void Gather(const std::vector<uint64_t>& ids, const py::object& blocks, uintptr_t stream) {
    std::vector<std::byte*> ptrs = Pointers(blocks, ids.size());
    absl::Status st;
    {
      GilReleased release;
      st = device_ ? kv_layout::GatherBlocksCuda(layout_, ids, ptrs,
                                                 reinterpret_cast<CUstream_st*>(stream))
                   : kv_layout::GatherBlocks(layout_, ids, ptrs);
    }
    if (!st.ok()) Throw(st);
  }

  void Scatter(const std::vector<uint64_t>& ids, const py::object& blocks, uintptr_t stream) {
    std::vector<std::byte*> p = Pointers(blocks, ids.size());
    std::vector<const std::byte*> ptrs(p.begin(), p.end());
    absl::Status st;
    {
      GilReleased release;
      st = device_ ? kv_layout::ScatterBlocksCuda(layout_, ids, ptrs,
                                                  reinterpret_cast<CUstream_st*>(stream))
                   : kv_layout::ScatterBlocks(layout_, ids, ptrs);
    }
    if (!st.ok()) Throw(st);
  }

 private:
  // `blocks`: one address per canonical block, or one int: the canonical blocks of `ids` paged
  // block ids back to back from that address (a count of ids that is not a multiple of
  // blocks_per_canonical is refused by the call).
  std::vector<std::byte*> Pointers(const py::object& blocks, size_t ids) const {
    const size_t n = ids / layout_.blocks_per_canonical;
    std::vector<std::byte*> out;
    if (py::isinstance<py::int_>(blocks)) {
      const uintptr_t base = blocks.cast<uintptr_t>();
      if (base == 0) throw py::value_error("kv layout: block buffer address 0 is null");
      for (size_t i = 0; i < n; ++i) {
        out.push_back(reinterpret_cast<std::byte*>(base + i * layout_.BlockBytes()));
      }
      return out;
    }
    for (uintptr_t a : blocks.cast<std::vector<uintptr_t>>()) {
      out.push_back(reinterpret_cast<std::byte*>(a));
    }
    return out;  // the count is checked against the ids by the call
  }

  kv_layout::PagedLayout layout_;
  bool device_;
};

}  // namespace
}  // namespace proxima::client

PYBIND11_MODULE(_proxima, m) {
  using namespace proxima::client;
  m.doc() = "libproxima for Python: plain-integer addresses, GIL released during calls";
  m.attr("KEY_BYTES") = kKeyBytes;
  g_main_thread =
      py::module_::import("threading").attr("main_thread")().attr("ident").cast<unsigned long>();

  static py::exception<void> error_type(m, "Error", PyExc_RuntimeError);
  g_error = error_type.ptr();
  PyObject* bases = PyTuple_Pack(2, g_error, PyExc_ConnectionError);
  g_unavailable = PyErr_NewException("proxima._proxima.Unavailable", bases, nullptr);
  Py_DECREF(bases);
  m.attr("Unavailable") = py::handle(g_unavailable);

  py::class_<Profile>(m, "Profile")
      .def_readonly("id", &Profile::id)
      .def_readonly("block_bytes", &Profile::block_bytes)
      .def("__repr__", [](const Profile& p) {
        return absl::StrCat("Profile(id=", p.id, ", block_bytes=", p.block_bytes, ")");
      });

  py::class_<Operation, std::shared_ptr<Operation>>(m, "Handle")
      .def("poll", &Operation::done, "True once the call has completed (never blocks)")
      .def("wait", &Operation::Wait, py::arg("timeout") = py::none(),
           "Waits for the call (GIL released) and returns its value or raises its error");

  py::class_<PyClient>(m, "Client")
      .def(py::init([](const std::string& target, const std::string& namespace_name,
                       const std::string& token, const std::string& tls_ca,
                       const std::string& tls_cert, const std::string& tls_key,
                       const std::string& tls_server_name, double connect_timeout,
                       double call_timeout, size_t async_threads, const std::string& transport,
                       const std::string& host_staging, const std::string& token_file) {
             ClientOptions o;
             o.transport = ValueOrThrow(ParseTransport(transport));
             o.host_staging = ValueOrThrow(ParseHostStaging(host_staging));
             o.target = target;
             o.namespace_name = namespace_name;
             o.token = token;
             o.token_file = token_file;
             o.tls_ca_file = tls_ca;
             o.tls_cert_file = tls_cert;
             o.tls_key_file = tls_key;
             o.tls_server_name = tls_server_name;
             o.connect_timeout = absl::Seconds(connect_timeout);
             o.call_timeout = absl::Seconds(call_timeout);
             return std::make_unique<PyClient>(std::move(o), async_threads);
           }),
           py::arg("target") = "unix:/run/proxima/proximad.sock", py::arg("namespace") = "default",
           py::arg("token") = "", py::arg("tls_ca") = "", py::arg("tls_cert") = "",
           py::arg("tls_key") = "", py::arg("tls_server_name") = "",
           py::arg("connect_timeout") = 5.0, py::arg("call_timeout") = 30.0,
           py::arg("async_threads") = 2, py::arg("transport") = "auto",
           py::arg("host_staging") = "auto", py::arg("token_file") = "",
           "token_file: a file holding the token, read again every 10 s, so that a rotated "
           "token is presented without a new Client (not with token). "
           "transport: 'auto' (UCX when the daemon serves it and reaches this process, else "
           "inline), 'ucx' (UCX or fail) or 'inline'. host_staging: 'auto' (blocks in ordinary "
           "memory move through UCX-allocated staging when the daemon reaches this process over "
           "posix/sysv shared memory), 'always' or 'never'")
      .def("register_profile", &PyClient::RegisterProfile, py::arg("num_layers"),
           py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("tokens_per_block"),
           py::arg("dtype"), py::arg("fingerprint") = "", py::arg("rope_theta") = 0.0,
           "rope_theta: the model's RoPE base (Hugging Face config rope_theta; 0 = unknown), "
           "which k4v3 levels quantize K with (proxima.engine.model_rope_theta reads it)")
      .def("register_buffer", &PyClient::RegisterBuffer, py::arg("address"), py::arg("length"),
           "Pieces of blocks may lie in [address, address + length); over UCX the buffer is "
           "registered once here, not on every call. ValueError on a null address, a zero "
           "length or an overlap with a registered buffer")
      .def("unregister_buffer", &PyClient::UnregisterBuffer, py::arg("address"),
           "Forgets the buffer registered at `address` (False if none); not for alloc_buffer's "
           "memory (close the Buffer)")
      .def("alloc_buffer", &PyClient::AllocBuffer, py::arg("length"),
           "A Buffer of `length` zeroed bytes that UCX allocated (over shared memory the daemon "
           "copies into and out of it directly), already registered; the buffer protocol gives "
           "views without copies; close() unregisters and frees it")
      .def("put", &PyClient::Put, py::arg("profile"), py::arg("keys"), py::arg("blocks"),
           py::arg("positions") = std::vector<int64_t>{}, py::arg("high_priority") = false,
           py::arg("importance") = std::vector<float>{},
           "positions: empty or one per block, its index in the sequence (0 = the first block, "
           "the attention sinks; negative = unknown); high_priority: held at a safer level of "
           "the namespace's compression hierarchy; importance: empty or one hint per block "
           "(> 0: keep longer)")
      .def("get", &PyClient::Get, py::arg("profile"), py::arg("keys"), py::arg("blocks"))
      .def("lookup", &PyClient::Lookup, py::arg("profile"), py::arg("keys"))
      .def("exists", &PyClient::Exists, py::arg("profile"), py::arg("keys"))
      .def("delete", &PyClient::Delete, py::arg("profile"), py::arg("keys"))
      .def("put_async", &PyClient::PutAsync, py::arg("profile"), py::arg("keys"), py::arg("blocks"),
           py::arg("positions") = std::vector<int64_t>{}, py::arg("high_priority") = false,
           py::arg("importance") = std::vector<float>{})
      .def("get_async", &PyClient::GetAsync, py::arg("profile"), py::arg("keys"), py::arg("blocks"))
      .def("lookup_async", &PyClient::LookupAsync, py::arg("profile"), py::arg("keys"))
      .def("exists_async", &PyClient::ExistsAsync, py::arg("profile"), py::arg("keys"))
      .def("stats_json", &PyClient::StatsJson)
      .def_property_readonly("server_info", &PyClient::ServerInfoDict)
      .def_property_readonly("crc_failures", &PyClient::crc_failures)
      .def_property_readonly("registered_buffers", &PyClient::registered_buffers)
      .def_property_readonly("transport", &PyClient::transport, "'ucx' or 'inline'")
      .def_property_readonly("transport_detail", &PyClient::transport_detail,
                             "why that transport (e.g. 'inline: proximad has UCX disabled')");

  py::class_<PyBuffer>(m, "Buffer", py::custom_type_setup([](PyHeapTypeObject* heap_type) {
                         heap_type->as_buffer.bf_getbuffer = &PyBuffer::GetBuffer;
                         heap_type->as_buffer.bf_releasebuffer = &PyBuffer::ReleaseBuffer;
                         heap_type->ht_type.tp_as_buffer = &heap_type->as_buffer;
                       }),
                       "Memory from Client.alloc_buffer, registered with that client")
      .def_property_readonly("address", &PyBuffer::address,
                             "the first byte's address (ValueError once closed)")
      .def_property_readonly("length", &PyBuffer::length)
      .def_property_readonly("closed", &PyBuffer::closed)
      .def("__len__", &PyBuffer::length)
      .def("close", &PyBuffer::Close,
           "Unregisters and frees the memory (idempotent); BufferError while views of it exist")
      .def("__enter__", [](py::object self) { return self; })
      .def("__exit__", [](PyBuffer& b, py::args) { b.Close(); })
      .def("__repr__", [](const PyBuffer& b) {
        return b.closed()
                   ? absl::StrCat("Buffer(length=", b.length(), ", closed)")
                   : absl::StrCat("Buffer(address=", b.address(), ", length=", b.length(), ")");
      });

  m.attr("KV_LAYOUT_CUDA") = proxima::gpu::BuiltWithCuda();
  m.attr("KV_NO_BLOCK") = proxima::kv_layout::kNoBlock;
  py::class_<PyKvLayout>(m, "KvLayout",
                         "Paged KV tensors (addresses and element strides) and gather/scatter "
                         "of canonical blocks [layer][k|v][token][head][dim]")
      .def(py::init<const std::vector<PyKvLayout::LayerTuple>&,
                    const std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t>&, uint64_t,
                    uint32_t, uint32_t, uint32_t, uint32_t, bool, uint32_t>(),
           py::arg("layers"), py::arg("strides"), py::arg("num_blocks"), py::arg("num_kv_heads"),
           py::arg("head_dim"), py::arg("tokens_per_block"), py::arg("element_size"),
           py::arg("device") = false, py::arg("blocks_per_canonical") = 1,
           "layers: per layer (k_address, v_address or 0, k_size_bytes or 0, v_size_bytes or 0); "
           "strides: element strides of the (kv, block, token, head, dim) axes; device: the "
           "addresses are CUDA device memory and the CUDA kernel copies; blocks_per_canonical: "
           "paged blocks (of tokens_per_block tokens) per canonical block, their tokens one "
           "after the other")
      .def_property_readonly("block_bytes", &PyKvLayout::block_bytes)
      .def_property_readonly("device", &PyKvLayout::device)
      .def("gather", &PyKvLayout::Gather, py::arg("block_ids"), py::arg("blocks"),
           py::arg("stream") = 0,
           "Copies paged blocks block_ids[i*n:(i+1)*n] (n = blocks_per_canonical) of every "
           "layer into canonical block i; an id of KV_NO_BLOCK leaves its part of the canonical "
           "block as it was. blocks is a list of addresses or one address (blocks back to back). "
           "device=True: enqueued on `stream` (a cudaStream_t as int, 0 = default stream), not "
           "synchronised")
      .def("scatter", &PyKvLayout::Scatter, py::arg("block_ids"), py::arg("blocks"),
           py::arg("stream") = 0,
           "The reverse of gather; block ids other than KV_NO_BLOCK (not written) must be "
           "distinct");
}
