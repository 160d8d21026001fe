// Turns on shared CPU cores, so that a rank's measured compute time is its time on a whole core.
//
// When more ranks than cores run on a machine (4 ranks on 2 cores), the elapsed time of a rank's
// compute would include the time its core partner computed meanwhile, and how much depends on
// the plan (a partner that waits for a message frees the core). With a lease, the ranks sharing a
// core take turns: a rank holds the lease only while it computes and gives it back whenever it
// waits for communication (inside tensor-parallel collectives too, or two peers on one core would
// deadlock). A compute section's elapsed time is then what a device of the rank's own would
// report, and anything else that takes the core (another process, a CPU quota, a stopped
// process) still slows whoever holds it, so the monitor sees it.
//
// The lease is a POSIX named semaphore with one slot per core of the group (cores / threads per
// rank); its name is unique to the job and unlinked as soon as every member has opened it, so
// nothing is left behind even when the job is killed. A rank with a core of its own in a job
// where others share gets a lease without a semaphore: it never waits for a turn, but it waits
// for communication the way its peers do (below).
#pragma once

#include <semaphore.h>

#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.h"

namespace malleus::runtime {

class CoreLease {
 public:
  ~CoreLease();
  CoreLease(const CoreLease&) = delete;
  CoreLease& operator=(const CoreLease&) = delete;

  // Blocks until this rank may compute (a slot of its cores is free).
  void acquire();
  void release();
  bool held() const { return held_; }
  int slots() const { return slots_; }

  // Holds the lease for a scope; a no-op when `lease` is null or already held here.
  class Hold {
   public:
    explicit Hold(CoreLease* lease);
    ~Hold();
    Hold(const Hold&) = delete;
    Hold& operator=(const Hold&) = delete;

   private:
    CoreLease* lease_ = nullptr;
  };
  // Gives the lease back for a scope in which the rank waits for others, and takes it again at
  // the end; a no-op when `lease` is null or not held.
  class Gap {
   public:
    explicit Gap(CoreLease* lease);
    ~Gap();
    Gap(const Gap&) = delete;
    Gap& operator=(const Gap&) = delete;

   private:
    CoreLease* lease_ = nullptr;
  };

 private:
  friend struct CoreSharing;
  CoreLease(sem_t* semaphore, int slots) : semaphore_(semaphore), slots_(slots) {}

  sem_t* semaphore_ = nullptr;
  int slots_ = 1;
  bool held_ = false;
};

// Waiting for communication without taking a shared core from the rank that computes. MPI's own
// waits poll without pause (sched_yield at best), which on a shared core steals time from the
// partner holding the lease and inflates what it measures. With a lease these give the lease
// back, use nonblocking collectives, poll with MPI_Test and short sleeps, and take the lease
// again; with none (`lease` null: no rank of the job shares a core) they are MPI's blocking
// calls, the fastest when every rank has its core to itself. Every rank of a job must be in the
// same case, as CoreSharing::detect ensures: MPI never matches a blocking collective with a
// nonblocking one.
void wait(comm::Request& request, CoreLease* lease);
void wait_all(std::vector<comm::Request>& requests, CoreLease* lease);
void all_reduce_sum(const comm::Communicator& comm, float* data, size_t count, CoreLease* lease);
void all_reduce_sum(const comm::Communicator& comm, double* data, size_t count, CoreLease* lease);
void all_reduce_max(const comm::Communicator& comm, float* data, size_t count, CoreLease* lease);
// Communicator::reduce_scatter_sum and all_gather_in_place, waited for in the same way.
void reduce_scatter_sum(const comm::Communicator& comm, const float* send, float* receive,
                        const std::vector<int>& counts, CoreLease* lease);
void all_gather_in_place(const comm::Communicator& comm, float* data,
                         const std::vector<int>& counts, const std::vector<int>& displacements,
                         CoreLease* lease);

// How this job's ranks sit on the machine's cores.
struct CoreSharing {
  // Collective over `world`. Reads every rank's CPU affinity; ranks on one host that all have
  // the same unrestricted mask and outnumber its cores (× threads) are first bound one per core
  // (local rank i to core i mod cores). Ranks with identical masks that outnumber the mask's
  // cores share a lease; when some do, every other rank gets a lease without a semaphore;
  // `lease` is null when no rank of the job shares its cores.
  static CoreSharing detect(const comm::Communicator& world, int threads_per_rank);

  std::shared_ptr<CoreLease> lease;
  // One line for the job's log (the same on every rank), e.g. "4 ranks on 2 cores: bound one per
  // core; ranks sharing a core take turns (core lease)".
  std::string summary;
  // Every rank's process id and the CPUs it may run on ("1", "0-3"), in rank order: where
  // a tool outside malleus finds a rank (to slow it in experiments, for instance).
  std::vector<int> pids;
  std::vector<std::string> cpus;
};

}  // namespace malleus::runtime
