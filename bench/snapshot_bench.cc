// snapshot_bench: how fast a daemon writes its host tier to tiers.host.snapshot_file at SIGTERM
// and reads it back at start (daemon/snapshot.h), against the disk's own speed for the same bytes
// measured in the same run: a plain sequential write of the same number of blocks of the same
// size followed by fsync, and a plain read of them back. The ratio says what the format, the CRC
// checks and the block index cost on top of the disk; the baseline says how many GB a node's
// tiers.host.snapshot_seconds buys.
//
//   snapshot_bench [--dir=/tmp] [--gib=2] [--block_mib=2] [--rounds=3] [--drop_caches=0|1]
//
// --drop_caches=1 (root only) drops the page cache before each read, so reads come from the disk
// rather than memory (a restart after a reboot); otherwise the reads mostly hit the cache that
// the write just filled (a daemon restarted in place). Each round runs the baseline and the
// snapshot in turn (alternating which goes first); medians are printed as JSON lines.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "bench/args.h"
#include "common/crc32c.h"
#include "daemon/metrics.h"
#include "daemon/snapshot.h"
#include "daemon/tier_service.h"

namespace proxima::bench {
namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point since) {
  return std::chrono::duration<double>(Clock::now() - since).count();
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

bool DropCaches() {
  ::sync();
  std::ofstream f("/proc/sys/vm/drop_caches");
  f << "3\n";
  f.flush();
  return f.good();
}

// A profile whose raw block is `block_bytes` (bf16, 16 tokens, 8 heads, 128 dim, L layers).
v1::ModelProfile ProfileOf(uint64_t block_bytes) {
  v1::ModelProfile p;
  p.set_num_layers(static_cast<uint32_t>(block_bytes / (2 * 16 * 8 * 128 * 2)));
  p.set_num_kv_heads(8);
  p.set_head_dim(128);
  p.set_tokens_per_block(16);
  p.set_dtype(v1::DTYPE_BF16);
  p.set_fingerprint("snapshot-bench");
  return p;
}

std::unique_ptr<daemon::TierService> Service(uint64_t capacity, metrics::Registry* registry) {
  daemon::DaemonConfig config;
  config.host_tier.capacity_bytes = capacity;
  config.server.max_message_bytes = 64 << 20;
  absl::StatusOr<std::unique_ptr<daemon::TierService>> s =
      daemon::TierService::Create(config, registry);
  if (!s.ok()) {
    std::fprintf(stderr, "snapshot_bench: %s\n", s.status().ToString().c_str());
    std::exit(1);
  }
  return *std::move(s);
}

int Main(int argc, char** argv) {
  const std::string dir = Arg(argc, argv, "dir", "/tmp");
  double gib = 2, block_mib = 2;
  int rounds = 3, drop = 0;
  if (!absl::SimpleAtod(Arg(argc, argv, "gib", "2"), &gib) ||
      !absl::SimpleAtod(Arg(argc, argv, "block_mib", "2"), &block_mib) ||
      !absl::SimpleAtoi(Arg(argc, argv, "rounds", "3"), &rounds) ||
      !absl::SimpleAtoi(Arg(argc, argv, "drop_caches", "0"), &drop) || rounds < 1 || gib <= 0 ||
      block_mib <= 0) {
    std::fprintf(stderr,
                 "usage: snapshot_bench [--dir=/tmp] [--gib=2] [--block_mib=2] "
                 "[--rounds=3] [--drop_caches=0|1]\n");
    return 2;
  }
  const uint64_t block_bytes = static_cast<uint64_t>(block_mib * (1 << 20)) /
                               (2 * 16 * 8 * 128 * 2) * (2 * 16 * 8 * 128 * 2);
  const uint64_t capacity = static_cast<uint64_t>(gib * (1ull << 30));
  const size_t blocks = capacity / block_bytes;
  const double total = static_cast<double>(blocks * block_bytes);

  metrics::Registry registry;
  std::unique_ptr<daemon::TierService> core = Service(capacity, &registry);
  const v1::ModelProfile profile = ProfileOf(block_bytes);
  if (!core->AddProfile(0, profile).ok()) return 1;
  std::vector<std::byte> data(block_bytes);
  uint32_t x = 12345;
  for (std::byte& b : data) {
    x = x * 1664525u + 1013904223u;
    b = static_cast<std::byte>(x >> 24);
  }
  for (size_t n = 0; n < blocks; ++n) {
    daemon::BlockId id{0, daemon::ProfileId(profile), {}, 0};
    std::memcpy(id.key.data(), &n, sizeof(n));
    std::memcpy(data.data(), &n, sizeof(n));  // each block its own bytes
    if (core->store().Put(id, data, Crc32c(data)) != daemon::PutOutcome::kStored) {
      std::fprintf(stderr, "snapshot_bench: block %zu not stored\n", n);
      return 1;
    }
  }
  const std::string snap = dir + "/proxima-snapshot-bench";
  const std::string plain = dir + "/proxima-snapshot-bench.plain";
  bool dropped = drop != 0;

  std::vector<double> base_w, base_r, base_fresh_r, snap_w, snap_r;
  for (int round = 0; round < rounds; ++round) {
    auto baseline = [&] {
      Clock::time_point t = Clock::now();
      const int fd = ::open(plain.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
      for (size_t n = 0; n < blocks && fd >= 0; ++n) {
        if (::write(fd, data.data(), data.size()) != static_cast<ssize_t>(data.size())) {
          std::perror("snapshot_bench: write");
          std::exit(1);
        }
      }
      if (fd < 0 || ::fsync(fd) != 0 || ::close(fd) != 0) {
        std::perror("snapshot_bench: baseline file");
        std::exit(1);
      }
      base_w.push_back(total / Seconds(t) / 1e9);
      if (drop != 0) dropped = DropCaches() && dropped;
      t = Clock::now();
      const int rfd = ::open(plain.c_str(), O_RDONLY | O_CLOEXEC);
      std::vector<std::byte> in(block_bytes);
      for (size_t n = 0; n < blocks; ++n) {
        if (::pread(rfd, in.data(), in.size(), static_cast<off_t>(n * block_bytes)) !=
            static_cast<ssize_t>(in.size())) {
          std::perror("snapshot_bench: read");
          std::exit(1);
        }
      }
      base_r.push_back(total / Seconds(t) / 1e9);
      // Into fresh memory, as a starting daemon's tier is: every page is faulted in and zeroed
      // by the kernel on its first write (what the load cannot avoid either).
      if (drop != 0) dropped = DropCaches() && dropped;
      void* fresh = ::mmap(nullptr, blocks * block_bytes, PROT_READ | PROT_WRITE,
                           MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (fresh == MAP_FAILED) {
        std::perror("snapshot_bench: mmap");
        std::exit(1);
      }
      t = Clock::now();
      for (size_t n = 0; n < blocks; ++n) {
        if (::pread(rfd, static_cast<char*>(fresh) + n * block_bytes, block_bytes,
                    static_cast<off_t>(n * block_bytes)) != static_cast<ssize_t>(block_bytes)) {
          std::perror("snapshot_bench: read");
          std::exit(1);
        }
      }
      base_fresh_r.push_back(total / Seconds(t) / 1e9);
      ::munmap(fresh, blocks * block_bytes);
      ::close(rfd);
      ::unlink(plain.c_str());
    };
    auto snapshot = [&] {
      Clock::time_point t = Clock::now();
      absl::StatusOr<daemon::snapshot::Written> w =
          daemon::snapshot::Write(*core, snap, absl::InfiniteFuture());
      if (!w.ok() || w->blocks != blocks) {
        std::fprintf(stderr, "snapshot_bench: write: %s\n", w.status().ToString().c_str());
        std::exit(1);
      }
      snap_w.push_back(total / Seconds(t) / 1e9);
      if (drop != 0) dropped = DropCaches() && dropped;
      metrics::Registry r2;
      std::unique_ptr<daemon::TierService> next = Service(capacity, &r2);
      t = Clock::now();
      absl::StatusOr<daemon::snapshot::Loaded> l = daemon::snapshot::Load(*next, snap);
      const double s = Seconds(t);
      if (!l.ok() || l->blocks != blocks) {
        std::fprintf(stderr, "snapshot_bench: load: %s (%llu blocks)\n",
                     l.status().ToString().c_str(),
                     static_cast<unsigned long long>(l.ok() ? l->blocks : 0));
        std::exit(1);
      }
      snap_r.push_back(total / s / 1e9);
    };
    if (round % 2 == 0) {
      baseline();
      snapshot();
    } else {
      snapshot();
      baseline();
    }
  }
  const char* cache = drop == 0 ? "warm" : dropped ? "dropped" : "drop_failed";
  std::printf(
      "{\"bench\":\"snapshot\",\"op\":\"write\",\"bytes\":%.0f,\"block_bytes\":%llu,"
      "\"rounds\":%d,\"snapshot_gbps\":%.3f,\"baseline_gbps\":%.3f,\"ratio\":%.3f}\n",
      total, static_cast<unsigned long long>(block_bytes), rounds, Median(snap_w), Median(base_w),
      Median(snap_w) / Median(base_w));
  // baseline: a read into fresh memory (the load's own situation); reused_buffer: the same reads
  // into one buffer used again for every block (the disk or page cache alone).
  std::printf(
      "{\"bench\":\"snapshot\",\"op\":\"load\",\"bytes\":%.0f,\"block_bytes\":%llu,"
      "\"rounds\":%d,\"page_cache\":\"%s\",\"snapshot_gbps\":%.3f,\"baseline_gbps\":%.3f,"
      "\"ratio\":%.3f,\"reused_buffer_gbps\":%.3f,\"ratio_reused\":%.3f}\n",
      total, static_cast<unsigned long long>(block_bytes), rounds, cache, Median(snap_r),
      Median(base_fresh_r), Median(snap_r) / Median(base_fresh_r), Median(base_r),
      Median(snap_r) / Median(base_r));
  return 0;
}

}  // namespace
}  // namespace proxima::bench

int main(int argc, char** argv) { return proxima::bench::Main(argc, argv); }
