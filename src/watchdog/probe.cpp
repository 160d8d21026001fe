#include "watchdog/probe.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <sstream>

#include "common/error.h"

namespace malleus::watchdog {

namespace {

double unix_now() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// The IPv4 address of dotted text, in host byte order; nullopt when it is not one.
std::optional<uint32_t> ipv4(const std::string& text) {
  in_addr a{};
  if (::inet_pton(AF_INET, text.c_str(), &a) != 1) return std::nullopt;
  return ntohl(a.s_addr);
}

// Whether `address` (host byte order) on interface `name` is in one of `network`'s entries.
bool in_network(uint32_t address, const std::string& name, const std::string& network) {
  std::istringstream entries(network);
  for (std::string entry; std::getline(entries, entry, ',');) {
    entry.erase(0, entry.find_first_not_of(" \t"));
    entry.erase(entry.find_last_not_of(" \t") + 1);
    if (entry.empty()) continue;
    const size_t slash = entry.find('/');
    if (slash == std::string::npos) {
      if (entry == name) return true;
      continue;
    }
    const auto base = ipv4(entry.substr(0, slash));
    const std::string bits_text = entry.substr(slash + 1);
    char* end = nullptr;
    const long bits = std::strtol(bits_text.c_str(), &end, 10);
    check(base && !bits_text.empty() && *end == '\0' && bits >= 0 && bits <= 32,
          "watchdog network \"" + network + "\": \"" + entry +
              "\" is neither an interface name nor a CIDR range like 198.18.13.0/24");
    const uint32_t mask = bits == 0 ? 0 : ~uint32_t{0} << (32 - bits);
    if ((address & mask) == (*base & mask)) return true;
  }
  return false;
}

// A non-blocking connect to `e`; -1 when it failed at once (no route: the link is down here).
int start_connect(const Endpoint& e) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  sockaddr_in to{};
  to.sin_family = AF_INET;
  to.sin_port = htons(static_cast<uint16_t>(e.port));
  ::inet_pton(AF_INET, e.address.c_str(), &to.sin_addr);
  if (::connect(fd, reinterpret_cast<const sockaddr*>(&to), sizeof to) == 0 ||
      errno == EINPROGRESS) {
    return fd;
  }
  // Refused at once: the host answered (its process is gone, the path is there).
  const bool answered = errno == ECONNREFUSED;
  ::close(fd);
  return answered ? -2 : -1;
}

// A connect that finished: whether the target host answered (connected, or refused: either way a
// packet came back over the path).
bool answered(int fd) {
  int error = 0;
  socklen_t size = sizeof error;
  if (::getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &size) != 0) return false;
  return error == 0 || error == ECONNREFUSED;
}

// One probe of a host: a connection to each of its endpoints at once.
struct Round {
  int generation = 0;
  double started = 0;
  std::vector<int> fds;
};

void close_all(Round& round) {
  for (int fd : round.fds) ::close(fd);
  round.fds.clear();
}

}  // namespace

std::string Endpoint::text() const {
  return address + ":" + std::to_string(port);
}

Endpoint Endpoint::parse(const std::string& text, const std::string& source) {
  const size_t colon = text.rfind(':');
  Endpoint e;
  if (colon != std::string::npos) {
    e.address = text.substr(0, colon);
    const std::string port = text.substr(colon + 1);
    char* end = nullptr;
    const long p = std::strtol(port.c_str(), &end, 10);
    if (ipv4(e.address) && !port.empty() && *end == '\0' && p >= 1 && p <= 65535) {
      e.port = static_cast<int>(p);
      return e;
    }
  }
  throw Error(source + ": \"" + text + "\" is not an address:port like 198.18.13.1:40123");
}

std::vector<std::string> job_addresses(const std::string& network) {
  ifaddrs* list = nullptr;
  check(::getifaddrs(&list) == 0,
        std::string("cannot list network interfaces: ") + std::strerror(errno));
  std::vector<std::string> addresses;
  for (const ifaddrs* i = list; i != nullptr; i = i->ifa_next) {
    if (i->ifa_addr == nullptr || i->ifa_addr->sa_family != AF_INET) continue;
    if ((i->ifa_flags & IFF_UP) == 0 || (i->ifa_flags & IFF_LOOPBACK) != 0) continue;
    const in_addr a = reinterpret_cast<const sockaddr_in*>(i->ifa_addr)->sin_addr;
    if (!network.empty() && !in_network(ntohl(a.s_addr), i->ifa_name, network)) continue;
    char text[INET_ADDRSTRLEN] = {};
    ::inet_ntop(AF_INET, &a, text, sizeof text);
    if (std::find(addresses.begin(), addresses.end(), text) == addresses.end()) {
      addresses.emplace_back(text);
    }
  }
  ::freeifaddrs(list);
  return addresses;
}

std::string job_network() {
  for (const char* name : {"MALLEUS_WATCHDOG_NETWORK", "OMPI_MCA_btl_tcp_if_include"}) {
    const char* value = std::getenv(name);
    if (value != nullptr && *value != '\0') return value;
  }
  return "";
}

Prober::Prober(std::vector<std::string> addresses) : addresses_(std::move(addresses)) {
  listener_ = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  check(listener_ >= 0, std::string("watchdog: cannot open a socket: ") + std::strerror(errno));
  sockaddr_in any{};
  any.sin_family = AF_INET;
  any.sin_addr.s_addr = htonl(INADDR_ANY);
  socklen_t size = sizeof any;
  const bool listening =
      ::bind(listener_, reinterpret_cast<const sockaddr*>(&any), sizeof any) == 0 &&
      ::listen(listener_, 128) == 0 &&
      ::getsockname(listener_, reinterpret_cast<sockaddr*>(&any), &size) == 0 &&
      ::pipe2(wake_, O_NONBLOCK | O_CLOEXEC) == 0;
  if (!listening) {
    const std::string why = std::strerror(errno);
    ::close(listener_);
    throw Error("watchdog: cannot listen for probes: " + why);
  }
  port_ = ntohs(any.sin_port);
  thread_ = std::thread([this] { loop(); });
}

Prober::~Prober() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  const char byte = 0;
  (void)!::write(wake_[1], &byte, 1);
  thread_.join();
  for (int fd : {listener_, wake_[0], wake_[1]}) ::close(fd);
}

std::vector<Endpoint> Prober::endpoints() const {
  std::vector<Endpoint> out;
  for (const auto& a : addresses_) out.push_back({a, port_});
  return out;
}

void Prober::set_targets(std::map<std::string, std::vector<Endpoint>> targets) {
  {
    std::lock_guard lock(mutex_);
    targets_ = std::move(targets);
    reach_.clear();
    const double now = unix_now();
    for (const auto& [host, _] : targets_) reach_[host].since = now;
    ++generation_;
  }
  const char byte = 0;
  (void)!::write(wake_[1], &byte, 1);
}

bool Prober::probing() const {
  std::lock_guard lock(mutex_);
  return !targets_.empty();
}

std::map<std::string, Reach> Prober::reach() const {
  std::lock_guard lock(mutex_);
  return reach_;
}

void Prober::loop() {
  std::map<std::string, Round> rounds;  // the probe in flight per host
  std::map<std::string, double> next;   // when each host's next probe starts
  for (;;) {
    std::map<std::string, std::vector<Endpoint>> targets;
    int generation = 0;
    {
      std::lock_guard lock(mutex_);
      if (stopping_) break;
      targets = targets_;
      generation = generation_;
    }
    const double now = unix_now();
    // A host's probe ends: recorded, unless its targets were replaced meanwhile.
    const auto finish = [&](const std::string& host, Round& round, bool ok) {
      close_all(round);
      std::lock_guard lock(mutex_);
      if (round.generation != generation_) return;
      Reach& r = reach_[host];
      const bool was_failing = r.last_fail > r.last_ok;
      (ok ? r.last_ok : r.last_fail) = unix_now();
      ++r.probes;
      r.failures += ok ? 0 : 1;
      r.spells += !ok && !was_failing ? 1 : 0;
    };
    for (auto it = rounds.begin(); it != rounds.end();) {
      const bool stale = it->second.generation != generation || !targets.count(it->first);
      if (stale || now - it->second.started > kTimeoutS) {
        if (!stale) finish(it->first, it->second, false);
        close_all(it->second);
        it = rounds.erase(it);
      } else {
        ++it;
      }
    }
    for (const auto& [host, endpoints] : targets) {
      if (rounds.count(host) || now < next[host]) continue;
      next[host] = now + kIntervalS;
      Round round{generation, now, {}};
      bool refused = false;
      for (const Endpoint& e : endpoints) {
        const int fd = start_connect(e);
        if (fd >= 0) round.fds.push_back(fd);
        refused = refused || fd == -2;
      }
      if (refused || round.fds.empty()) {
        finish(host, round, refused);
      } else {
        rounds[host] = std::move(round);
      }
    }

    std::vector<pollfd> fds = {{listener_, POLLIN, 0}, {wake_[0], POLLIN, 0}};
    std::vector<std::pair<std::string, int>> owners;  // host and fd of fds[2...]
    for (const auto& [host, round] : rounds) {
      for (int fd : round.fds) {
        fds.push_back({fd, POLLOUT, 0});
        owners.emplace_back(host, fd);
      }
    }
    const int wait_ms = targets.empty() ? 1000 : static_cast<int>(kIntervalS * 1000 / 5);
    if (::poll(fds.data(), fds.size(), wait_ms) < 0 && errno != EINTR) break;
    // Probes from other hosts: the handshake was the answer; accept and close.
    if (fds[0].revents != 0) {
      for (int fd; (fd = ::accept4(listener_, nullptr, nullptr, SOCK_CLOEXEC)) >= 0;) ::close(fd);
    }
    char drain[64];
    while (::read(wake_[0], drain, sizeof drain) > 0) {
    }
    for (size_t i = 2; i < fds.size(); ++i) {
      if (fds[i].revents == 0) continue;
      const auto& [host, fd] = owners[i - 2];
      const auto it = rounds.find(host);
      if (it == rounds.end()) continue;  // finished by another of its connections
      Round& round = it->second;
      if (answered(fd)) {
        finish(host, round, true);
        rounds.erase(it);
        continue;
      }
      ::close(fd);
      round.fds.erase(std::find(round.fds.begin(), round.fds.end(), fd));
      if (round.fds.empty()) {
        finish(host, round, false);
        rounds.erase(it);
      }
    }
  }
  for (auto& [_, round] : rounds) close_all(round);
}

}  // namespace malleus::watchdog
