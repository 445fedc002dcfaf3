#include "transport/liveness.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>

#include <fmt/format.h>

#include "common/error.h"
#include "transport/deadline.h"
#include "transport/mpi_check.h"

namespace colibri {
namespace {

using Clock = std::chrono::steady_clock;

constexpr char kHeartbeat = 'H', kReported = 'E', kBye = 'B', kAccepted = 'A';
constexpr double kConnectSeconds = 1.0;  // per address, and for the hub's acceptance
// A connection that closes unannounced is acted on this much later (see lose()).
constexpr double kGraceSeconds = 0.2;

// The fds abort_job tells ('E'), each stored as fd + 1 (0: a free slot).
constexpr int kMaxPeers = 4096;
std::atomic<int> g_peers[kMaxPeers];

void remember_peer(int fd) {
  for (auto& slot : g_peers) {
    int empty = 0;
    if (slot.compare_exchange_strong(empty, fd + 1)) return;
  }
}

void forget_peer(int fd) {
  for (auto& slot : g_peers) {
    int mine = fd + 1;
    if (slot.compare_exchange_strong(mine, 0)) return;
  }
}

void send_byte(int fd, char byte) {
  (void)!::send(fd, &byte, 1, MSG_NOSIGNAL | MSG_DONTWAIT);
}

int period_ms(const LivenessOptions& options) {
  return std::clamp(int(options.period_s * 500), 10, 1000);  // polls twice a period
}

// A wake-up pipe for a thread blocked in poll.
void open_wake(int (&pipe)[2]) {
  if (::pipe2(pipe, O_CLOEXEC | O_NONBLOCK) != 0) fail("pipe: {}", std::strerror(errno));
}
void close_fds(std::initializer_list<int> fds) {
  for (int fd : fds)
    if (fd >= 0) ::close(fd);
}

// Reads what arrived without blocking; false when the peer closed or reset the connection.
bool drain(int fd, std::string& bytes) {
  char buffer[64];
  for (;;) {
    const ssize_t n = ::recv(fd, buffer, sizeof buffer, MSG_DONTWAIT);
    if (n > 0) {
      bytes.append(buffer, size_t(n));
      continue;
    }
    if (n == 0) return false;
    return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR;
  }
}

bool read_exact(int fd, void* data, size_t size, double seconds) {
  auto* p = static_cast<char*>(data);
  const auto end = Clock::now() + std::chrono::milliseconds(int(seconds * 1e3));
  while (size > 0) {
    const int left =
        int(std::chrono::duration_cast<std::chrono::milliseconds>(end - Clock::now()).count());
    pollfd fd_in{fd, POLLIN, 0};
    if (left <= 0 || ::poll(&fd_in, 1, left) <= 0) return false;
    const ssize_t n = ::recv(fd, p, size, MSG_DONTWAIT);
    if (n <= 0 && !(n < 0 && (errno == EAGAIN || errno == EINTR))) return false;
    if (n > 0) {
      p += n;
      size -= size_t(n);
    }
  }
  return true;
}

void set_nodelay(int fd) {
  const int on = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &on, sizeof on);
}

// This host's IPv4 addresses, those of up interfaces, loopback last.
std::vector<std::string> host_addresses() {
  std::vector<std::string> out, loopback;
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) return {"127.0.0.1"};
  for (ifaddrs* a = list; a; a = a->ifa_next) {
    if (!a->ifa_addr || a->ifa_addr->sa_family != AF_INET || !(a->ifa_flags & IFF_UP)) continue;
    char text[INET_ADDRSTRLEN];
    ::inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(a->ifa_addr)->sin_addr, text, sizeof text);
    ((a->ifa_flags & IFF_LOOPBACK) ? loopback : out).push_back(text);
  }
  ::freeifaddrs(list);
  out.insert(out.end(), loopback.begin(), loopback.end());
  return out;
}

// Silence measured as the time this process ran: a gap between two polls longer than a second
// (this process was stopped, or not scheduled) is not counted against the peer.
struct Silence {
  Clock::time_point last_poll = Clock::now();
  double seconds = 0;
  void tick(bool heard) {
    const auto now = Clock::now();
    const double gap = std::chrono::duration<double>(now - last_poll).count();
    last_poll = now;
    seconds = heard ? 0 : seconds + (gap > WaitClock::kPauseSeconds ? 0 : gap);
  }
};

struct Address {
  uint64_t nonce = 0;
  int port = 0;
  std::vector<std::string> ips;
};

std::string format_address(const Address& a) {
  std::string ips;
  for (const std::string& ip : a.ips) ips += (ips.empty() ? "" : ",") + ip;
  return fmt::format("{:016x};{};{}", a.nonce, a.port, ips);
}

Address parse_address(const std::string& text) {
  Address a;
  const size_t first = text.find(';'), second = text.find(';', first + 1);
  if (first == std::string::npos || second == std::string::npos)
    fail("liveness address '{}' is malformed", text);
  a.nonce = std::stoull(text.substr(0, first), nullptr, 16);
  a.port = std::stoi(text.substr(first + 1, second - first - 1));
  std::string rest = text.substr(second + 1);
  for (size_t at = 0; at <= rest.size();) {
    const size_t comma = std::min(rest.find(',', at), rest.size());
    if (comma > at) a.ips.push_back(rest.substr(at, comma - at));
    at = comma + 1;
  }
  return a;
}

// A connection to ip:port within kConnectSeconds; -1 and `error` on failure.
int connect_within(const std::string& ip, int port, std::string& error) {
  sockaddr_in to{};
  to.sin_family = AF_INET;
  to.sin_port = htons(uint16_t(port));
  if (::inet_pton(AF_INET, ip.c_str(), &to.sin_addr) != 1) {
    error = "not an IPv4 address";
    return -1;
  }
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) {
    error = std::strerror(errno);
    return -1;
  }
  if (::connect(fd, reinterpret_cast<sockaddr*>(&to), sizeof to) != 0 && errno != EINPROGRESS) {
    error = std::strerror(errno);
    ::close(fd);
    return -1;
  }
  pollfd out{fd, POLLOUT, 0};
  int so_error = 0;
  socklen_t len = sizeof so_error;
  if (::poll(&out, 1, int(kConnectSeconds * 1e3)) <= 0) {
    error = "no answer";
  } else if (::getsockopt(fd, SOL_SOCKET, SO_ERROR, &so_error, &len) != 0 || so_error != 0) {
    error = std::strerror(so_error ? so_error : errno);
  } else {
    return fd;
  }
  ::close(fd);
  return -1;
}

}  // namespace

void liveness_report_error() {
  for (auto& slot : g_peers)
    if (const int stored = slot.load(); stored > 0) send_byte(stored - 1, kReported);
}

// ---- the coordinator's end ------------------------------------------------------------------

LivenessHub::LivenessHub(int rank, std::vector<int> ranks, const LivenessOptions& options)
    : rank_(rank), options_(options), ranks_(std::move(ranks)) {
  listener_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in any{};
  any.sin_family = AF_INET;
  any.sin_addr.s_addr = htonl(INADDR_ANY);
  socklen_t len = sizeof any;
  if (listener_ < 0 || ::bind(listener_, reinterpret_cast<sockaddr*>(&any), sizeof any) != 0 ||
      ::listen(listener_, SOMAXCONN) != 0 ||
      ::getsockname(listener_, reinterpret_cast<sockaddr*>(&any), &len) != 0)
    fail("the liveness listener on {}: {}", rank_identity().name_of(rank_), std::strerror(errno));
  Address address;
  nonce_ = (uint64_t(std::random_device{}()) << 32) ^ std::random_device{}();
  address.nonce = nonce_;
  address.port = ntohs(any.sin_port);
  address.ips = host_addresses();
  address_ = format_address(address);
  open_wake(wake_);
  thread_ = std::thread([this] { run(); });
}

LivenessHub::~LivenessHub() {
  stop_ = true;
  send_byte(wake_[1], 0);
  if (thread_.joinable()) thread_.join();
  close_fds({listener_, wake_[0], wake_[1]});
}

void LivenessHub::end() {
  if (stop_.exchange(true)) return;
  send_byte(wake_[1], 0);
  if (thread_.joinable()) thread_.join();
}

void LivenessHub::run() {
  struct Peer {
    int rank = -1;
    int fd = -1;
    bool reported = false, silence_checked = false;
    Silence silence;
    std::string bytes;  // what arrived in this poll
  };
  std::vector<Peer> peers;
  auto last_beat = Clock::now();
  const auto lose = [&](Peer& peer) {
    if (!peer.reported) {
      // Unannounced. When mpirun's teardown signals every rank at once (Ctrl-C), this process
      // ends within the grace without a line about its peers; else the rank is named, even if
      // this process is ending normally meanwhile (mpirun closes a chat's stdin at once).
      std::this_thread::sleep_for(std::chrono::milliseconds(int(kGraceSeconds * 1e3)));
      abort_job(fmt::format(
          "{} is gone: its process ended without a word (killed, or crashed); its liveness "
          "connection closed",
          rank_identity().name_of(peer.rank)));
    }
    run_abort_hook(fmt::format("the job is ending: {} failed", rank_identity().name_of(peer.rank)));
  };
  while (!stop_) {
    std::vector<pollfd> fds{{wake_[0], POLLIN, 0}, {listener_, POLLIN, 0}};
    for (const Peer& p : peers) fds.push_back({p.fd, POLLIN, 0});
    ::poll(fds.data(), nfds_t(fds.size()), period_ms(options_));
    if (stop_) break;
    if (fds[1].revents & POLLIN) {
      // A rank introduces itself: the nonce, then its rank; answered 'A'.
      const int fd = ::accept4(listener_, nullptr, nullptr, SOCK_CLOEXEC);
      uint64_t their_nonce = 0;
      int32_t their_rank = -1;
      if (fd >= 0 && read_exact(fd, &their_nonce, 8, kConnectSeconds) &&
          read_exact(fd, &their_rank, 4, kConnectSeconds) && their_nonce == nonce_ &&
          std::find(ranks_.begin(), ranks_.end(), their_rank) != ranks_.end()) {
        set_nodelay(fd);
        send_byte(fd, kAccepted);
        Peer& p = peers.emplace_back();
        p.rank = their_rank;
        p.fd = fd;
        p.silence_checked = std::find(options_.silence.begin(), options_.silence.end(),
                                      their_rank) != options_.silence.end();
        remember_peer(fd);
      } else if (fd >= 0) {
        ::close(fd);
      }
    }
    for (size_t i = 0; i < peers.size(); ++i) {
      Peer& p = peers[i];
      const bool readable = i + 2 < fds.size() && fds[i + 2].revents != 0;
      p.bytes.clear();
      const bool open = !readable || drain(p.fd, p.bytes);
      if (p.bytes.find(kReported) != std::string::npos) p.reported = true;
      p.silence.tick(!p.bytes.empty());
      if (!open) {
        forget_peer(p.fd);
        ::close(p.fd);
        p.fd = -1;
        lose(p);
        continue;
      }
      if (p.silence_checked && p.silence.seconds > options_.silence_s)
        abort_job(fmt::format(
            "{} is silent: nothing on its liveness connection for {:.1f} s (--rank-timeout); "
            "stopped, or cut off",
            rank_identity().name_of(p.rank), p.silence.seconds));
    }
    std::erase_if(peers, [](const Peer& p) { return p.fd < 0; });
    if (Clock::now() - last_beat >= std::chrono::milliseconds(int(options_.period_s * 1e3))) {
      for (const Peer& p : peers) send_byte(p.fd, kHeartbeat);
      last_beat = Clock::now();
    }
  }
  // end(): the ranks are told, then the connections close as the ranks exit.
  for (Peer& p : peers) {
    forget_peer(p.fd);
    send_byte(p.fd, kBye);
    ::shutdown(p.fd, SHUT_WR);
    ::close(p.fd);
  }
}

// ---- an expert rank's end --------------------------------------------------------------------

LivenessLink::LivenessLink(int rank, int coordinator, const std::string& address,
                           const LivenessOptions& options)
    : rank_(rank), coordinator_(coordinator), options_(options) {
  const Address a = parse_address(address);
  const RankIdentity& me = rank_identity();
  std::vector<std::string> ips = a.ips;
  // On the coordinator's host, loopback first.
  const bool same_host =
      size_t(coordinator) < me.hosts.size() && me.hosts[size_t(coordinator)] == me.host;
  if (same_host)
    std::stable_partition(ips.begin(), ips.end(),
                          [](const std::string& ip) { return ip.rfind("127.", 0) == 0; });
  std::string errors;
  for (const std::string& ip : ips) {
    std::string error;
    const int fd = connect_within(ip, a.port, error);
    if (fd >= 0) {
      const int flags = ::fcntl(fd, F_GETFL);
      ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK);
      const int32_t mine = rank;
      char answer = 0;
      if (::send(fd, &a.nonce, 8, MSG_NOSIGNAL) == 8 && ::send(fd, &mine, 4, MSG_NOSIGNAL) == 4 &&
          read_exact(fd, &answer, 1, kConnectSeconds) && answer == kAccepted) {
        set_nodelay(fd);
        sock_ = fd;
        break;
      }
      error = "not the coordinator's listener";
      ::close(fd);
    }
    errors += fmt::format("{}{}:{} {}", errors.empty() ? "" : ", ", ip, a.port, error);
  }
  if (sock_ < 0) {
    std::fprintf(stderr,
                 "[%s] warning: no liveness connection to the coordinator (%s): a death of either "
                 "is noticed by mpirun's teardown only\n",
                 me.name_of(rank).c_str(), errors.c_str());
    return;
  }
  remember_peer(sock_);
  open_wake(wake_);
  thread_ = std::thread([this] { run(); });
}

LivenessLink::~LivenessLink() {
  stop_ = true;
  if (wake_[1] >= 0) send_byte(wake_[1], 0);
  if (thread_.joinable()) thread_.join();
  if (sock_ >= 0) forget_peer(sock_);
  close_fds({sock_, wake_[0], wake_[1]});
}

void LivenessLink::run() {
  const bool silence_checked =
      std::find(options_.silence.begin(), options_.silence.end(), rank_) != options_.silence.end();
  Silence silence;
  std::string bytes;
  auto last_beat = Clock::now();
  const std::string coordinator = rank_identity().name_of(coordinator_);
  while (!stop_) {
    pollfd fds[2] = {{wake_[0], POLLIN, 0}, {sock_, POLLIN, 0}};
    ::poll(fds, 2, period_ms(options_));
    if (stop_) return;
    const bool readable = fds[1].revents != 0;
    bytes.clear();
    const bool open = !readable || drain(sock_, bytes);
    if (bytes.find(kBye) != std::string::npos || bytes.find(kReported) != std::string::npos)
      return;  // the job ends normally, or the coordinator reports its own error
    silence.tick(!bytes.empty());
    if (!open) {
      // mpirun's teardown normally ends this rank well within this wait.
      for (double waited = 0; waited < kAbortTeardownSeconds && !stop_; waited += 0.05)
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
      if (stop_) return;
      abort_job(fmt::format(
          "the coordinator {} is gone: its process ended without a word (killed, or crashed)",
          coordinator));
    }
    if (silence_checked && silence.seconds > options_.silence_s + kAbortTeardownSeconds)
      abort_job(fmt::format(
          "the coordinator {} is silent: nothing on its liveness connection for {:.1f} s "
          "(--rank-timeout); stopped, or cut off",
          coordinator, silence.seconds));
    if (Clock::now() - last_beat >= std::chrono::milliseconds(int(options_.period_s * 1e3))) {
      send_byte(sock_, kHeartbeat);
      last_beat = Clock::now();
    }
  }
}

}  // namespace colibri
