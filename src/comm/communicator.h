// The runtime's view of MPI: one Communicator per TP group, pipeline and gradient-sync owner
// set, rebuilt whenever a re-plan changes the groups. Ownership is shared and freeing is
// automatic, so dropping an old plan's groups cannot leak MPI communicators, and every entry
// point checks its arguments (ranks, counts, sizes) so that a plan/layout bug surfaces as a
// malleus::Error naming the problem instead of a hang or silent corruption inside MPI.
//
// MPI errors keep the default handler (MPI_ERRORS_ARE_FATAL): a failed MPI call aborts the job.
//
// Device memory (comm/staging.h): a buffer in memory a backend registered as its device's is
// staged through host memory around every call (or given to a CUDA-aware MPI as it is), so the
// callers hand device buffers and host buffers alike.
#pragma once

#include <mpi.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "comm/staging.h"

namespace malleus::comm {

// One outstanding nonblocking send or receive. Movable, not copyable. A Request is never
// abandoned: the destructor (and move-assignment over a pending request) waits for it, so a
// buffer can never be freed while MPI still reads or writes it. Destroy requests before the
// buffers they use.
class Request {
 public:
  Request() = default;  // already complete
  ~Request();
  Request(Request&& other) noexcept;
  Request& operator=(Request&& other) noexcept;
  Request(const Request&) = delete;
  Request& operator=(const Request&) = delete;

  // Blocks until the operation completes; a no-op if it already has. For a receive, throws Error
  // if the message that arrived is shorter than the posted length (a longer one is an MPI
  // truncation error, fatal under MPI_ERRORS_ARE_FATAL). Staged device buffers that MPI wrote
  // are copied back to the device once it completes (by wait, test, wait_all or the destructor).
  void wait();
  // Completes the operation if it is done (with the same check as wait()); returns whether it is.
  bool test();
  bool pending() const { return request_ != MPI_REQUEST_NULL; }

  // Waits for all requests (pending or not) in one MPI_Waitall; then checks receives as wait().
  static void wait_all(std::vector<Request>& requests);

 private:
  friend class Communicator;
  // A started collective (no length to check) and its staged buffers.
  static Request posted(MPI_Request request, std::vector<StagedBuffer> staged) {
    return Request(request, false, 0, -1, 0, std::move(staged));
  }
  Request(MPI_Request request, bool is_receive, size_t bytes, int peer, int tag,
          std::vector<StagedBuffer> staged = {})
      : request_(request),
        is_receive_(is_receive),
        bytes_(bytes),
        peer_(peer),
        tag_(tag),
        staged_(std::move(staged)) {}
  // Checks a completed receive's length and copies staged buffers back; request_ must already be
  // MPI_REQUEST_NULL.
  void check_completed(const MPI_Status& status);
  // Waits without checking (destructor, move-assignment).
  void complete_quietly() noexcept;

  MPI_Request request_ = MPI_REQUEST_NULL;
  bool is_receive_ = false;
  size_t bytes_ = 0;
  int peer_ = -1;
  int tag_ = 0;
  std::vector<StagedBuffer> staged_;  // device buffers MPI sees through host copies
};

// An MPI communicator with shared ownership: copies refer to the same MPI_Comm, which is freed
// (MPI_Comm_free) when the last copy goes away, unless it is MPI_COMM_WORLD or MPI was
// already finalized. A default-constructed Communicator is empty; using it throws Error.
// (MPI_Comm_free is formally collective; Open MPI frees locally, and in any case the runtime
// drops a plan's communicators on all members together.)
//
// Collectives must be called by every rank of the communicator, in the same order, with the
// same counts (and root). Only the thread that constructed the MpiSession may call MPI.
class Communicator {
 public:
  Communicator() = default;

  // All processes of the job (MPI_COMM_WORLD). Throws Error if MPI is not initialized.
  static Communicator world();

  bool valid() const { return state_ != nullptr; }
  int rank() const;
  int size() const;
  // World rank of rank `rank_in_this` of this communicator.
  int world_rank(int rank_in_this) const;
  // world_ranks()[i] is the world rank of rank i.
  const std::vector<int>& world_ranks() const;
  // Rank in this communicator of world rank `world_rank`, or -1 if it is not a member.
  int rank_of_world(int world_rank) const;

  // A new communicator of exactly `world_ranks`, in this order: its rank i is world_ranks[i].
  // The ranks must be distinct members of this communicator, and the calling rank must be one
  // of them. Collective over the listed ranks only (MPI_Comm_create_group): non-members do not
  // call it, so disjoint groups can be built concurrently. Overlapping groups must be created
  // in the same relative order on all their members (for example, every rank walks the plan's
  // group list in the same order and creates the groups it belongs to), otherwise two ranks
  // can wait on each other forever. A group of one rank is a duplicate of MPI_COMM_SELF.
  Communicator subgroup(const std::vector<int>& world_ranks) const;

  // In-place element-wise reductions over all ranks (MPI_IN_PLACE); counts above INT_MAX are
  // reduced in chunks of 2^30 elements.
  void all_reduce_sum(float* data, size_t count) const;
  void all_reduce_sum(double* data, size_t count) const;
  void all_reduce_max(float* data, size_t count) const;
  void all_reduce_max(double* data, size_t count) const;
  // Scalar forms; pass a double or an int64_t (a plain int argument is ambiguous).
  double all_reduce_sum(double value) const;
  int64_t all_reduce_sum(int64_t value) const;
  double all_reduce_max(double value) const;

  // Nonblocking forms (MPI_Iallreduce, in place): the data is reduced once the request
  // completes. At most INT_MAX elements (checked, Error otherwise). Used to wait for a
  // collective without MPI's busy polling (runtime/core_lease.h).
  Request iall_reduce_sum(float* data, size_t count) const;
  Request iall_reduce_sum(double* data, size_t count) const;
  Request iall_reduce_max(float* data, size_t count) const;

  // Reduce-scatter and all-gather with uneven parts (the distributed optimizer's slices): rank i's
  // part is `counts[i]` elements at `displacements[i]` of a buffer of the parts laid end to end
  // (displacements[i] = Σ counts[<i]). reduce_scatter_sum sums `send` (the whole buffer) over all
  // ranks and leaves this rank's part in `receive`; all_gather_in_place fills every rank's part of
  // `data` from its owner (this rank's part must already be in place). At most INT_MAX elements
  // in all (checked). The nonblocking forms read `counts` and `displacements` until the request
  // completes: keep them alive until then.
  void reduce_scatter_sum(const float* send, float* receive, const std::vector<int>& counts) const;
  void all_gather_in_place(float* data, const std::vector<int>& counts,
                           const std::vector<int>& displacements) const;
  Request ireduce_scatter_sum(const float* send, float* receive,
                              const std::vector<int>& counts) const;
  Request iall_gather_in_place(float* data, const std::vector<int>& counts,
                               const std::vector<int>& displacements) const;

  // Copies `bytes` bytes from rank `root`'s buffer into every other rank's buffer.
  void broadcast(void* data, size_t bytes, int root) const;
  void barrier() const;
  // Variable-length text (manifests, JSON verdicts): `root`'s text on every rank, and every
  // rank's text on `root` in rank order (empty elsewhere). At most INT_MAX bytes each (checked).
  std::string broadcast_text(const std::string& text, int root) const;
  std::vector<std::string> gather_text(const std::string& text, int root) const;
  // Ends every process of the job (MPI_Abort): for an error on one rank that the others, waiting
  // in a collective, would never hear about.
  [[noreturn]] void abort(int code) const;

  // Nonblocking byte point-to-point; dest/source are ranks of this communicator, tags are in
  // [0, MPI_TAG_UB]. Messages are limited to INT_MAX bytes (checked, Error otherwise): the
  // runtime's activations and migration pieces are far smaller, and one message per request
  // keeps a receive's length check exact. A receive must be posted with the exact length sent.
  Request isend(const void* data, size_t bytes, int dest, int tag) const;
  Request irecv(void* data, size_t bytes, int source, int tag) const;

  // The underlying handle, for MPI calls this class does not wrap. Do not free it.
  MPI_Comm handle() const;

 private:
  struct State;
  explicit Communicator(std::shared_ptr<const State> state) : state_(std::move(state)) {}
  // Throws Error if empty; live_state() also if MPI is not usable (for calls into MPI).
  const State& state() const;
  const State& live_state() const;

  std::shared_ptr<const State> state_;
};

// One rank's failure known to all: a collective step that may fail on some ranks only (a file
// that one rank cannot read) runs as `agree_on_error(world, error_of([&] { ... }))`, and either
// every rank goes on or every rank throws the same Error.
//
// What `body` threw (its message), or "" when it returned. Not collective.
std::string error_of(const std::function<void()>& body);
// Collective: when `error` is non-empty on any rank, every rank throws Error with the message of
// the lowest failing rank; otherwise returns on every rank.
void agree_on_error(const Communicator& world, const std::string& error);

}  // namespace malleus::comm
