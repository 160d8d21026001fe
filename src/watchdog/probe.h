// The side channel that tells a partition from a hang (watchdog/partition.h): while a phase of the
// job is overdue, the leader rank of each host (its lowest rank) opens TCP connections to the
// leader of every other host, over the job's own network and outside MPI, so it works while MPI's
// collectives are stuck. A probe is a TCP handshake only, completed by the target host's kernel:
// it tests the path between the hosts, not the process (a stopped process is its heartbeat's
// business), and it needs no thread of the target to run.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace malleus::watchdog {

// An IPv4 address and port, written "198.18.13.1:40123".
struct Endpoint {
  std::string address;
  int port = 0;
  std::string text() const;
  // Throws Error naming `source` for anything else than "a.b.c.d:port".
  static Endpoint parse(const std::string& text, const std::string& source);
  bool operator==(const Endpoint&) const = default;
};

// The IPv4 addresses of this host's interfaces that are up, loopback left out, kept to `network`
// when it is not empty: comma-separated CIDR ranges ("198.18.13.0/24") and interface names
// ("eth0"), as Open MPI's btl_tcp_if_include takes them. Throws Error for a malformed entry.
std::vector<std::string> job_addresses(const std::string& network);
// The job's network from the environment: $MALLEUS_WATCHDOG_NETWORK, else Open MPI's
// $OMPI_MCA_btl_tcp_if_include (which `mpirun --mca btl_tcp_if_include ...` gives every rank),
// else "" (every interface).
std::string job_network();

// What the probes of one other host found. Times are Unix seconds; 0: never.
struct Reach {
  double since = 0;                  // when probing it began
  double last_ok = 0;                // the latest probe that connected
  double last_fail = 0;              // the latest probe that did not within the timeout
  int64_t probes = 0, failures = 0;  // since it began
  int64_t spells = 0;                // runs of failed probes between probes that connected
};

// One rank's end of the side channel: a listening socket (its connections accepted and closed by
// a thread), and, while targets are set, a probe of every target host every kIntervalS, each
// given kTimeoutS to connect (to any of the host's endpoints). The timeout is shorter than the
// kernel's first resend of a connection request (1 s), so a probe whose request or answer was
// lost fails: the share of failed probes is about the share of packets a link loses, twice.
class Prober {
 public:
  static constexpr double kIntervalS = 0.25;
  static constexpr double kTimeoutS = 0.9;

  // Listens on every address (an ephemeral port); `addresses` are where it says it is reached.
  explicit Prober(std::vector<std::string> addresses);
  ~Prober();
  Prober(const Prober&) = delete;
  Prober& operator=(const Prober&) = delete;

  std::vector<Endpoint> endpoints() const;
  // Probes these hosts (name → endpoints of its leader) from now on, with fresh records; an empty
  // map stops probing.
  void set_targets(std::map<std::string, std::vector<Endpoint>> targets);
  bool probing() const;
  std::map<std::string, Reach> reach() const;

 private:
  void loop();

  int listener_ = -1;
  int wake_[2] = {-1, -1};
  int port_ = 0;
  std::vector<std::string> addresses_;

  mutable std::mutex mutex_;
  bool stopping_ = false;
  std::map<std::string, std::vector<Endpoint>> targets_;
  std::map<std::string, Reach> reach_;
  int generation_ = 0;  // bumped by set_targets: probes of earlier targets are dropped
  std::thread thread_;
};

}  // namespace malleus::watchdog
