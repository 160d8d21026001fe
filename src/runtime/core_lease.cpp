#include "runtime/core_lease.h"

#include <dirent.h>
#include <fcntl.h>
#include <sched.h>
#include <sys/stat.h>
#include <unistd.h>

#include <time.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <map>
#include <vector>

#include "common/error.h"
#include "common/hash.h"

namespace malleus::runtime {

namespace {

constexpr int kMaskWords = CPU_SETSIZE / 32;  // the mask travels as 32-bit words in doubles
constexpr int kFields = 4 + kMaskWords;       // host (2 halves), pid, lease serial, mask

using Mask = std::vector<int>;  // sorted CPU numbers

std::string format_cpus(const Mask& cpus) {
  std::string text;
  for (size_t i = 0; i < cpus.size();) {
    size_t j = i;
    while (j + 1 < cpus.size() && cpus[j + 1] == cpus[j] + 1) ++j;
    if (!text.empty()) text += ',';
    text += std::to_string(cpus[i]);
    if (j > i) {
      text += '-';
      text += std::to_string(cpus[j]);
    }
    i = j + 1;
  }
  return text;
}

std::string format_ranks(const std::vector<int>& ranks) {
  std::string text;
  for (int r : ranks) {
    if (!text.empty()) text += ',';
    text += std::to_string(r);
  }
  return text;
}

// Binds every thread of this process (OpenMP's pool may already exist) to `cpus`.
void bind_process(const Mask& cpus) {
  cpu_set_t set;
  CPU_ZERO(&set);
  for (int c : cpus) CPU_SET(c, &set);
  check(
      sched_setaffinity(0, sizeof set, &set) == 0,
      std::string("binding this rank to CPUs ") + format_cpus(cpus) + ": " + std::strerror(errno));
  if (DIR* tasks = opendir("/proc/self/task")) {
    while (const dirent* entry = readdir(tasks)) {
      const int tid = std::atoi(entry->d_name);
      if (tid > 0) sched_setaffinity(tid, sizeof set, &set);  // a thread may have just ended
    }
    closedir(tasks);
  }
}

int next_serial() {
  static int serial = 0;
  return serial++;
}

// Every rank's host, pid, lease serial and CPU mask, from one all-reduce of disjoint slots.
struct Placement {
  std::vector<uint64_t> hosts, pids, serials;
  std::vector<Mask> masks;
};

Placement gather_placement(const comm::Communicator& world) {
  const int me = world.rank(), ranks = world.size();
  cpu_set_t set;
  CPU_ZERO(&set);
  check(sched_getaffinity(0, sizeof set, &set) == 0,
        std::string("reading this rank's CPU affinity: ") + std::strerror(errno));
  char host[256] = {};
  gethostname(host, sizeof host - 1);
  const uint64_t host_hash = hash_text(host);
  const int serial = next_serial();
  std::vector<double> all(static_cast<size_t>(kFields) * ranks, 0.0);
  double* mine = all.data() + static_cast<size_t>(kFields) * me;
  mine[0] = static_cast<double>(host_hash >> 32);
  mine[1] = static_cast<double>(host_hash & 0xffffffffu);
  mine[2] = static_cast<double>(getpid());
  mine[3] = serial;
  for (int c = 0; c < CPU_SETSIZE; ++c) {
    if (CPU_ISSET(c, &set)) mine[4 + c / 32] += static_cast<double>(uint64_t{1} << (c % 32));
  }
  world.all_reduce_sum(all.data(), all.size());
  auto field = [&](int rank, int f) {
    return static_cast<uint64_t>(all[static_cast<size_t>(kFields) * rank + f]);
  };
  Placement placement;
  placement.masks.resize(static_cast<size_t>(ranks));
  for (int r = 0; r < ranks; ++r) {
    placement.hosts.push_back((field(r, 0) << 32) | field(r, 1));
    placement.pids.push_back(field(r, 2));
    placement.serials.push_back(field(r, 3));
    for (int c = 0; c < CPU_SETSIZE; ++c) {
      if ((field(r, 4 + c / 32) >> (c % 32)) & 1u) placement.masks[r].push_back(c);
    }
  }
  return placement;
}

// Ranks of one host left unbound and oversubscribed (the same mask everywhere, with fewer CPUs
// than the ranks need) are bound round-robin to its CPUs: their masks change, and this rank
// (`me`), if among them, is bound. Says so in `notes`.
void bind_unbound(const std::vector<int>& local, int threads_per_rank, int me,
                  std::vector<Mask>* masks, std::vector<std::string>* notes) {
  const Mask first = (*masks)[local.front()];
  const bool same =
      std::all_of(local.begin(), local.end(), [&](int r) { return (*masks)[r] == first; });
  const size_t cpus = first.size();
  if (!same || local.size() <= 1 || local.size() * threads_per_rank <= cpus || cpus == 0) return;
  for (size_t i = 0; i < local.size(); ++i) {
    Mask bound;
    for (int t = 0; t < threads_per_rank; ++t) {
      bound.push_back(first[(i * threads_per_rank + t) % cpus]);
    }
    std::sort(bound.begin(), bound.end());
    bound.erase(std::unique(bound.begin(), bound.end()), bound.end());
    (*masks)[local[i]] = bound;
  }
  notes->push_back(std::to_string(local.size()) + " ranks on " + std::to_string(cpus) +
                   " CPUs were unbound: malleus bound them (rank i to CPU i mod " +
                   std::to_string(cpus) + ")");
  if (std::find(local.begin(), local.end(), me) != local.end()) bind_process((*masks)[me]);
}

// Different masks that overlap: their timings include each other, and nothing corrects it.
void warn_overlaps(const std::map<Mask, std::vector<int>>& by_mask,
                   std::vector<std::string>* notes) {
  for (auto a = by_mask.begin(); a != by_mask.end(); ++a) {
    for (auto b = std::next(a); b != by_mask.end(); ++b) {
      Mask common;
      std::set_intersection(a->first.begin(), a->first.end(), b->first.begin(), b->first.end(),
                            std::back_inserter(common));
      if (!common.empty()) {
        notes->push_back("warning: ranks " + format_ranks(a->second) + " and " +
                         format_ranks(b->second) + " overlap on CPU " + format_cpus(common) +
                         " with different masks, so their measured times include each other's "
                         "work (bind them, e.g. mpirun --bind-to core)");
      }
    }
  }
}

// This rank's lease: the semaphore's name (empty when its CPUs are its own), whether it creates
// it, how many ranks may hold it at once; and whether any rank of the job takes turns.
struct LeaseChoice {
  std::string name;
  bool leader = false, any = false;
  int slots = 1;
};

// Ranks of one host with identical masks share a lease when they outnumber its slots: the lease
// of this rank (`me`), if among them, into `choice`.
void choose_lease(const Placement& placement, const std::vector<int>& local, int threads_per_rank,
                  int me, LeaseChoice* choice, std::vector<std::string>* notes) {
  std::map<Mask, std::vector<int>> by_mask;
  for (int r : local) by_mask[placement.masks[r]].push_back(r);
  for (const auto& [mask, group] : by_mask) {
    const int slots = std::max(1, static_cast<int>(mask.size()) / threads_per_rank);
    if (static_cast<int>(group.size()) <= slots) continue;
    choice->any = true;
    notes->push_back("ranks " + format_ranks(group) + " share CPU " + format_cpus(mask) +
                     " and take turns (core lease, " + std::to_string(slots) + " at a time)");
    if (std::find(group.begin(), group.end(), me) == group.end()) continue;
    const auto leader = static_cast<size_t>(group.front());
    choice->name = "/malleus-lease-" + std::to_string(placement.pids[leader]) + "-" +
                   std::to_string(placement.serials[leader]);
    choice->leader = me == group.front();
    choice->slots = slots;
  }
  warn_overlaps(by_mask, notes);
}

// The leader creates the semaphore, the others open it once it exists, and the leader unlinks it
// once all have: it then lives exactly as long as the processes that use it. Collective.
sem_t* open_lease(const comm::Communicator& world, const LeaseChoice& choice) {
  sem_t* semaphore = SEM_FAILED;
  if (choice.leader) {
    sem_unlink(choice.name.c_str());  // a stale one from a killed job whose pid was recycled
    semaphore =
        sem_open(choice.name.c_str(), O_CREAT | O_EXCL, 0600, static_cast<unsigned>(choice.slots));
    check(semaphore != SEM_FAILED,
          "core lease: creating semaphore " + choice.name + ": " + std::strerror(errno));
  }
  world.barrier();
  if (!choice.name.empty() && !choice.leader) {
    semaphore = sem_open(choice.name.c_str(), 0);
    check(semaphore != SEM_FAILED,
          "core lease: opening semaphore " + choice.name + ": " + std::strerror(errno));
  }
  world.barrier();
  if (choice.leader) sem_unlink(choice.name.c_str());
  return semaphore;
}

}  // namespace

CoreLease::~CoreLease() {
  if (semaphore_ == nullptr) return;
  if (held_) sem_post(semaphore_);
  sem_close(semaphore_);
}

void CoreLease::acquire() {
  check(!held_, "core lease: acquired twice");
  while (semaphore_ != nullptr && sem_wait(semaphore_) != 0) {
    check(errno == EINTR, std::string("core lease: sem_wait failed: ") + std::strerror(errno));
  }
  held_ = true;
}

void CoreLease::release() {
  check(held_, "core lease: released without holding it");
  held_ = false;
  if (semaphore_ != nullptr) sem_post(semaphore_);
}

CoreLease::Hold::Hold(CoreLease* lease) {
  if (lease != nullptr && !lease->held()) {
    lease->acquire();
    lease_ = lease;
  }
}

CoreLease::Hold::~Hold() {
  if (lease_ != nullptr) lease_->release();
}

CoreLease::Gap::Gap(CoreLease* lease) {
  if (lease != nullptr && lease->held()) {
    lease->release();
    lease_ = lease;
  }
}

CoreLease::Gap::~Gap() {
  if (lease_ != nullptr) lease_->acquire();
}

namespace {

// Polls until `done()`, sleeping between polls: a waiting rank leaves its core to the one
// computing (20 µs asked, ~70 µs with the kernel's timer slack: small next to a compute section).
template <typename Done>
void poll_gently(Done&& done) {
  const timespec pause{0, 20000};
  while (!done()) nanosleep(&pause, nullptr);
}

// Runs a collective while this rank holds no turn on its cores: the blocking call where its cores
// are its own (or the count does not fit MPI's int for the non-blocking form), otherwise started
// non-blocking and polled gently, so the ranks it shares cores with compute meanwhile.
template <typename Blocking, typename Start>
void collective_in_turn(CoreLease* lease, bool blocking_only, Blocking&& blocking, Start&& start) {
  CoreLease::Gap gap(lease);
  if (lease == nullptr || blocking_only) {
    blocking();
    return;
  }
  comm::Request request = start();
  poll_gently([&] { return request.test(); });
}

}  // namespace

void wait(comm::Request& request, CoreLease* lease) {
  if (lease == nullptr) {
    request.wait();
    return;
  }
  CoreLease::Gap gap(lease);
  poll_gently([&] { return request.test(); });
}

void wait_all(std::vector<comm::Request>& requests, CoreLease* lease) {
  if (lease == nullptr) {
    comm::Request::wait_all(requests);
    return;
  }
  CoreLease::Gap gap(lease);
  for (comm::Request& request : requests) poll_gently([&] { return request.test(); });
}

void all_reduce_sum(const comm::Communicator& comm, float* data, size_t count, CoreLease* lease) {
  collective_in_turn(
      lease, count > static_cast<size_t>(INT_MAX), [&] { comm.all_reduce_sum(data, count); },
      [&] { return comm.iall_reduce_sum(data, count); });
}

void all_reduce_sum(const comm::Communicator& comm, double* data, size_t count, CoreLease* lease) {
  collective_in_turn(
      lease, count > static_cast<size_t>(INT_MAX), [&] { comm.all_reduce_sum(data, count); },
      [&] { return comm.iall_reduce_sum(data, count); });
}

void all_reduce_max(const comm::Communicator& comm, float* data, size_t count, CoreLease* lease) {
  collective_in_turn(
      lease, count > static_cast<size_t>(INT_MAX), [&] { comm.all_reduce_max(data, count); },
      [&] { return comm.iall_reduce_max(data, count); });
}

void reduce_scatter_sum(const comm::Communicator& comm, const float* send, float* receive,
                        const std::vector<int>& counts, CoreLease* lease) {
  collective_in_turn(
      lease, false, [&] { comm.reduce_scatter_sum(send, receive, counts); },
      [&] { return comm.ireduce_scatter_sum(send, receive, counts); });
}

void all_gather_in_place(const comm::Communicator& comm, float* data,
                         const std::vector<int>& counts, const std::vector<int>& displacements,
                         CoreLease* lease) {
  collective_in_turn(
      lease, false, [&] { comm.all_gather_in_place(data, counts, displacements); },
      [&] { return comm.iall_gather_in_place(data, counts, displacements); });
}

CoreSharing CoreSharing::detect(const comm::Communicator& world, int threads_per_rank) {
  check(threads_per_rank >= 1, "core sharing: threads per rank must be at least 1");
  const int me = world.rank(), ranks = world.size();
  Placement placement = gather_placement(world);
  std::map<uint64_t, std::vector<int>> by_host;
  for (int r = 0; r < ranks; ++r) by_host[placement.hosts[r]].push_back(r);
  std::vector<std::string> notes;
  LeaseChoice choice;
  for (const auto& [h, local] : by_host) {
    bind_unbound(local, threads_per_rank, me, &placement.masks, &notes);
    choose_lease(placement, local, threads_per_rank, me, &choice, &notes);
  }
  CoreSharing result;
  if (sem_t* semaphore = open_lease(world, choice); semaphore != SEM_FAILED) {
    result.lease.reset(new CoreLease(semaphore, choice.slots));
  } else if (choice.any) {
    // A core of its own in a job where others take turns: nothing to take turns on, but its
    // collectives must be the nonblocking kind its peers use (MPI never matches a blocking
    // collective with a nonblocking one), so it gets a lease without a semaphore.
    result.lease.reset(new CoreLease(nullptr, static_cast<int>(placement.masks[me].size())));
  }
  for (int r = 0; r < ranks; ++r) {
    result.pids.push_back(static_cast<int>(placement.pids[r]));
    result.cpus.push_back(format_cpus(placement.masks[r]));
  }
  if (notes.empty()) {
    result.summary = "no host has more ranks than CPUs for them: no turns needed";
  } else {
    for (const auto& note : notes) {
      if (!result.summary.empty()) result.summary += "; ";
      result.summary += note;
    }
  }
  return result;
}

}  // namespace malleus::runtime
