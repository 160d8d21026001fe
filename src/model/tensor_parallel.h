// The collectives a model shard needs inside its tensor-parallel group. The model depends only on
// this interface; the runtime implements it over MPI. Without a group (one rank holds every head,
// FFN column and vocabulary row) no collective is needed and the model skips them.
#pragma once

#include <cstddef>
#include <memory>

namespace malleus::model {

template <typename T>
class TensorParallelGroup {
 public:
  // A sum started by start_all_reduce_sum and not yet waited for. The destructor waits too, so
  // the buffer is never freed under a reduction in flight.
  class Pending {
   public:
    virtual ~Pending() = default;
    // Returns once the data holds the group's sum.
    virtual void wait() = 0;
  };

  virtual ~TensorParallelGroup() = default;
  virtual int size() const = 0;
  // In place, over all ranks of the group; every rank gets the same result.
  virtual void all_reduce_sum(T* data, size_t count) = 0;
  virtual void all_reduce_max(T* data, size_t count) = 0;
  // The sum of all_reduce_sum without waiting for it (sub-pipelined tensor parallelism: the
  // reduction of one half of a micro-batch runs while the other half computes). The data must
  // not be touched until wait(). Every rank of the group starts and finishes its reductions in
  // the same order, and a group uses either this form or the blocking one for a given
  // reduction on all its ranks (MPI does not match a blocking collective with a nonblocking one).
  // A null result is a reduction already complete. Default: the blocking sum, and null.
  virtual std::unique_ptr<Pending> start_all_reduce_sum(T* data, size_t count) {
    all_reduce_sum(data, count);
    return nullptr;
  }
};

}  // namespace malleus::model
