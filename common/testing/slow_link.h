// SlowLink: a TCP forwarder on loopback that delivers every byte a fixed delay after it was sent,
// in both directions, so that a test sees what a distant or congested network does to connection
// set-up: a TLS handshake takes several round trips over it, an HTTP/2 connection at least one.
// Bytes are not held back by bandwidth, only by time, and keep their order. Thread-safe: the
// forwarding runs on its own threads (an acceptor, and a reader and a writer per direction of
// each connection); the destructor stops them and closes every socket.
#ifndef PROXIMA_COMMON_TESTING_SLOW_LINK_H_
#define PROXIMA_COMMON_TESTING_SLOW_LINK_H_

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace proxima::testing {

class SlowLink {
 public:
  // Listens on 127.0.0.1 (a port the kernel picks) and forwards each connection to
  // 127.0.0.1:`upstream_port`, every byte `delay` late each way.
  SlowLink(int upstream_port, std::chrono::milliseconds delay)
      : upstream_port_(upstream_port), delay_(delay) {
    listen_fd_ = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr = Loopback(0);
    socklen_t len = sizeof(addr);
    if (listen_fd_ < 0 || bind(listen_fd_, reinterpret_cast<sockaddr*>(&addr), len) != 0 ||
        listen(listen_fd_, 64) != 0 ||
        getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
      return;
    }
    port_ = ntohs(addr.sin_port);
    acceptor_ = std::thread([this] { Accept(); });
  }
  ~SlowLink() {
    stopping_ = true;
    if (listen_fd_ >= 0) shutdown(listen_fd_, SHUT_RDWR);
    if (acceptor_.joinable()) acceptor_.join();
    std::vector<std::unique_ptr<Connection>> connections;
    {
      std::lock_guard<std::mutex> lock(mu_);
      connections.swap(connections_);
    }
    for (auto& c : connections) c->Stop();
    if (listen_fd_ >= 0) close(listen_fd_);
  }
  SlowLink(const SlowLink&) = delete;
  SlowLink& operator=(const SlowLink&) = delete;

  bool ok() const { return port_ > 0; }
  int port() const { return port_; }
  std::string address() const { return "127.0.0.1:" + std::to_string(port_); }
  // Connections accepted so far.
  int connections() const {
    std::lock_guard<std::mutex> lock(mu_);
    return static_cast<int>(connections_.size());
  }

 private:
  // One direction of one connection: a reader stamps what it receives with the time it is due,
  // a writer sends it then. An empty chunk is the end of the stream (shut down on the far side).
  class Direction {
   public:
    Direction(int from, int to, std::chrono::milliseconds delay)
        : from_(from), to_(to), delay_(delay) {
      reader_ = std::thread([this] { Read(); });
      writer_ = std::thread([this] { Write(); });
    }
    void Stop() {
      {
        std::lock_guard<std::mutex> lock(mu_);
        stopping_ = true;
      }
      cv_.notify_all();
      reader_.join();
      writer_.join();
    }

   private:
    using Clock = std::chrono::steady_clock;
    void Read() {
      std::vector<char> buffer(64 << 10);
      for (;;) {
        const ssize_t n = recv(from_, buffer.data(), buffer.size(), 0);
        std::string chunk = n > 0 ? std::string(buffer.data(), static_cast<size_t>(n)) : "";
        {
          std::lock_guard<std::mutex> lock(mu_);
          queue_.emplace_back(Clock::now() + delay_, std::move(chunk));
        }
        cv_.notify_all();
        if (n <= 0) return;
      }
    }
    void Write() {
      std::unique_lock<std::mutex> lock(mu_);
      for (;;) {
        cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
        if (stopping_) return;
        const Clock::time_point due = queue_.front().first;
        if (cv_.wait_until(lock, due, [&] { return stopping_; })) return;
        std::string chunk = std::move(queue_.front().second);
        queue_.pop_front();
        lock.unlock();
        if (chunk.empty()) {
          shutdown(to_, SHUT_WR);
          return;
        }
        for (size_t sent = 0; sent < chunk.size();) {
          const ssize_t n = send(to_, chunk.data() + sent, chunk.size() - sent, MSG_NOSIGNAL);
          if (n <= 0) return;
          sent += static_cast<size_t>(n);
        }
        lock.lock();
      }
    }

    const int from_;
    const int to_;
    const std::chrono::milliseconds delay_;
    std::mutex mu_;
    std::condition_variable cv_;
    bool stopping_ = false;                                        // guarded by mu_
    std::deque<std::pair<Clock::time_point, std::string>> queue_;  // guarded by mu_
    std::thread reader_;
    std::thread writer_;
  };

  class Connection {
   public:
    Connection(int client, int upstream, std::chrono::milliseconds delay)
        : client_(client),
          upstream_(upstream),
          to_upstream_(client, upstream, delay),
          to_client_(upstream, client, delay) {}
    void Stop() {
      // Unblocks both readers (recv returns 0) and any writer's send.
      shutdown(client_, SHUT_RDWR);
      shutdown(upstream_, SHUT_RDWR);
      to_upstream_.Stop();
      to_client_.Stop();
      close(client_);
      close(upstream_);
    }

   private:
    const int client_;
    const int upstream_;
    Direction to_upstream_;
    Direction to_client_;
  };

  static sockaddr_in Loopback(int port) {
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = htons(static_cast<uint16_t>(port));
    return addr;
  }

  void Accept() {
    for (;;) {
      const int client = accept(listen_fd_, nullptr, nullptr);
      if (client < 0) {
        if (stopping_) return;
        continue;
      }
      const int upstream = socket(AF_INET, SOCK_STREAM, 0);
      sockaddr_in addr = Loopback(upstream_port_);
      if (upstream < 0 ||
          connect(upstream, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
        // The upstream server is down: the client sees its connection closed, as it would.
        if (upstream >= 0) close(upstream);
        close(client);
        continue;
      }
      std::lock_guard<std::mutex> lock(mu_);
      if (stopping_) {
        close(client);
        close(upstream);
        return;
      }
      connections_.push_back(std::make_unique<Connection>(client, upstream, delay_));
    }
  }

  const int upstream_port_;
  const std::chrono::milliseconds delay_;
  int listen_fd_ = -1;
  int port_ = 0;
  std::atomic<bool> stopping_{false};
  std::thread acceptor_;
  mutable std::mutex mu_;
  std::vector<std::unique_ptr<Connection>> connections_;  // guarded by mu_
};

}  // namespace proxima::testing

#endif  // PROXIMA_COMMON_TESTING_SLOW_LINK_H_
