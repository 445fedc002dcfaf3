#include "coordinator/http_connections.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <thread>

#include <fmt/format.h>

namespace colibri {
namespace {

using Clock = std::chrono::steady_clock;

int to_ms(double seconds) {
  return int(std::clamp(std::ceil(seconds * 1e3), 0.0, 2e9));
}

// One poll of one socket for `events`, retried on EINTR; the returned events, 0 on timeout.
short poll_socket(int sock, short events, int timeout_ms) {
  pollfd fd{sock, events, 0};
  for (;;) {
    const int n = ::poll(&fd, 1, timeout_ms);
    if (n > 0) return fd.revents;
    if (n == 0) return 0;
    if (errno != EINTR) return POLLERR;
  }
}

// The peer closed or reset the connection (pending request bytes count as alive).
bool peer_closed(int sock) {
  const short revents = poll_socket(sock, POLLIN | POLLRDHUP, 0);
  if (revents & (POLLERR | POLLHUP | POLLRDHUP | POLLNVAL)) return true;
  if (!(revents & POLLIN)) return false;
  char byte;
  const ssize_t n = ::recv(sock, &byte, 1, MSG_PEEK | MSG_DONTWAIT);
  return n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
}

std::string address_of(const sockaddr_storage& addr, int* port) {
  char text[INET6_ADDRSTRLEN] = "";
  if (addr.ss_family == AF_INET) {
    const auto* a = reinterpret_cast<const sockaddr_in*>(&addr);
    ::inet_ntop(AF_INET, &a->sin_addr, text, sizeof(text));
    if (port) *port = ntohs(a->sin_port);
  } else if (addr.ss_family == AF_INET6) {
    const auto* a = reinterpret_cast<const sockaddr_in6*>(&addr);
    ::inet_ntop(AF_INET6, &a->sin6_addr, text, sizeof(text));
    if (port) *port = ntohs(a->sin6_port);
  }
  return text;
}

std::string peer_address(int sock, int* port = nullptr) {
  sockaddr_storage addr{};
  socklen_t len = sizeof(addr);
  if (::getpeername(sock, reinterpret_cast<sockaddr*>(&addr), &len) != 0) return {};
  return address_of(addr, port);
}

// A connection's socket as cpp-httplib reads and writes it: buffered reads, each bounded by the
// I/O timeout and by the current request's deadline.
class ConnectionStream final : public httplib::Stream {
 public:
  ConnectionStream(int sock, const ConnectionLimits& limits) : sock_(sock), limits_(limits) {}

  void start_request() {
    deadline_ = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                   std::chrono::duration<double>(limits_.request_timeout_s));
    timed_out_ = false;
    written_ = 0;
  }
  bool buffered() const { return offset_ < filled_; }
  bool timed_out() const { return timed_out_; }
  size_t written() const { return written_; }
  int sock() const { return sock_; }

  bool is_readable() const override {
    const double left = std::chrono::duration<double>(deadline_ - Clock::now()).count();
    if (left <= 0) {
      timed_out_ = true;
      return false;
    }
    if (poll_socket(sock_, POLLIN, to_ms(std::min(left, limits_.io_timeout_s))) != 0) return true;
    timed_out_ = left <= limits_.io_timeout_s;  // the wait ended at the request's deadline
    return false;
  }
  bool is_writable() const override {
    return (poll_socket(sock_, POLLOUT, to_ms(limits_.io_timeout_s)) & POLLOUT) &&
           !peer_closed(sock_);
  }
  ssize_t read(char* ptr, size_t size) override {
    if (offset_ < filled_) {
      const size_t n = std::min(size, filled_ - offset_);
      std::memcpy(ptr, buffer_.data() + offset_, n);
      offset_ += n;
      return ssize_t(n);
    }
    if (!is_readable()) return -1;
    if (size >= buffer_.size()) return receive(ptr, size);
    const ssize_t n = receive(buffer_.data(), buffer_.size());
    if (n <= 0) return n;
    const size_t given = std::min(size, size_t(n));
    std::memcpy(ptr, buffer_.data(), given);
    offset_ = given;
    filled_ = size_t(n);
    return ssize_t(given);
  }
  ssize_t write(const char* ptr, size_t size) override {
    if (!(poll_socket(sock_, POLLOUT, to_ms(limits_.io_timeout_s)) & POLLOUT)) return -1;
    for (;;) {
      const ssize_t n = ::send(sock_, ptr, size, MSG_NOSIGNAL);
      if (n >= 0) written_ += size_t(n);
      if (n >= 0 || errno != EINTR) return n;
    }
  }
  void get_remote_ip_and_port(std::string& ip, int& port) const override {
    ip = peer_address(sock_, &port);
  }
  void get_local_ip_and_port(std::string& ip, int& port) const override {
    sockaddr_storage addr{};
    socklen_t len = sizeof(addr);
    if (::getsockname(sock_, reinterpret_cast<sockaddr*>(&addr), &len) == 0)
      ip = address_of(addr, &port);
  }
  int socket() const override { return sock_; }

 private:
  ssize_t receive(char* ptr, size_t size) {
    for (;;) {
      const ssize_t n = ::recv(sock_, ptr, size, 0);
      if (n >= 0 || errno != EINTR) return n;
    }
  }

  int sock_;
  const ConnectionLimits& limits_;
  Clock::time_point deadline_ = Clock::time_point::max();
  mutable bool timed_out_ = false;
  size_t written_ = 0;
  std::array<char, 4096> buffer_{};
  size_t offset_ = 0, filled_ = 0;
};

thread_local ConnectionStream* t_connection = nullptr;

// A thread per connection. Past `max_threads` (far beyond the caps, which refuse such
// connections cheaply) a connection waits for a thread to finish.
class ThreadPerConnection final : public httplib::TaskQueue {
 public:
  explicit ThreadPerConnection(int max_threads) : max_threads_(max_threads) {}

  void enqueue(std::function<void()> fn) override {
    std::lock_guard lock(mutex_);
    if (running_ >= max_threads_) {
      waiting_.push_back(std::move(fn));
      return;
    }
    ++running_;
    std::thread([this, fn = std::move(fn)]() mutable { run(std::move(fn)); }).detach();
  }
  void shutdown() override {
    std::unique_lock lock(mutex_);
    done_.wait(lock, [&] { return running_ == 0; });
  }

 private:
  void run(std::function<void()> fn) {
    for (;;) {
      fn();
      std::lock_guard lock(mutex_);
      if (waiting_.empty()) {
        if (--running_ == 0) done_.notify_all();
        return;
      }
      fn = std::move(waiting_.front());
      waiting_.pop_front();
    }
  }

  const int max_threads_;
  std::mutex mutex_;
  std::condition_variable done_;
  int running_ = 0;
  std::deque<std::function<void()>> waiting_;
};

}  // namespace

struct ConnectionServer::State {
  std::mutex mutex;
  int open = 0;
  std::map<std::string, int> per_client;
};

ConnectionServer::ConnectionServer(const ConnectionLimits& limits)
    : state_(std::make_unique<State>()), limits_(limits) {
  const int max_threads = limits_.max_connections + 256;
  new_task_queue = [max_threads] { return new ThreadPerConnection(max_threads); };
  set_keep_alive_max_count(limits_.keep_alive_max_requests);
  set_keep_alive_timeout(time_t(std::ceil(limits_.keep_alive_timeout_s)));  // the header it sends
}

ConnectionServer::~ConnectionServer() = default;

bool ConnectionServer::stopping() const {
  return svr_sock_ == INVALID_SOCKET;
}

void ConnectionServer::widen_backlog() {
  ::listen(svr_sock_, SOMAXCONN);
}

bool ConnectionServer::client_gone() {
  return t_connection && peer_closed(t_connection->sock());
}

bool ConnectionServer::request_timed_out() {
  return t_connection && t_connection->timed_out();
}

bool ConnectionServer::process_and_close_socket(int sock) {
  const std::string client = peer_address(sock);
  std::string refusal;
  {
    std::lock_guard lock(state_->mutex);
    int& mine = state_->per_client[client];
    if (state_->open >= limits_.max_connections) {
      refusal = "the server has its --max-connections open";
    } else if (mine >= limits_.max_per_client) {
      refusal = "this client has its --max-client-connections open";
    } else {
      ++state_->open;
      ++mine;
    }
    if (!refusal.empty() && mine == 0) state_->per_client.erase(client);
  }
  ConnectionStream stream(sock, limits_);
  const auto answer_raw = [&](int status, const char* reason, const std::string& message) {
    const std::string body = on_raw_error ? on_raw_error(status, message) : message;
    const std::string head = fmt::format(
        "HTTP/1.1 {} {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n"
        "Connection: close\r\n{}\r\n",
        status, reason, body.size(), status == 503 ? "Retry-After: 1\r\n" : "");
    stream.write(head.data(), head.size());
    stream.write(body.data(), body.size());
  };
  bool ok = true;
  if (!refusal.empty()) {
    answer_raw(503, "Service Unavailable", refusal);
  } else {
    t_connection = &stream;
    const int idle_slice_ms = 100;
    for (size_t served = 0; served < limits_.keep_alive_max_requests; ++served) {
      // The next request's first byte, within the keep-alive timeout, while the server runs.
      bool ready = stream.buffered();
      for (double idle = 0; !ready && idle < limits_.keep_alive_timeout_s && !stopping();
           idle += idle_slice_ms * 1e-3) {
        const short revents = poll_socket(sock, POLLIN, idle_slice_ms);
        if (revents & (POLLERR | POLLNVAL)) break;
        ready = revents != 0;
      }
      if (!ready || stopping()) break;
      stream.start_request();
      bool closed = false;
      ok = process_request(stream, served + 1 == limits_.keep_alive_max_requests, closed, nullptr);
      if (stream.timed_out() && stream.written() == 0)
        answer_raw(408, "Request Timeout",
                   fmt::format("the request did not arrive whole within --request-timeout ({} s)",
                               limits_.request_timeout_s));
      if (!ok || closed || stream.timed_out()) break;
    }
    t_connection = nullptr;
    std::lock_guard lock(state_->mutex);
    --state_->open;
    if (--state_->per_client[client] == 0) state_->per_client.erase(client);
  }
  ::shutdown(sock, SHUT_RDWR);
  ::close(sock);
  return ok;
}

}  // namespace colibri
