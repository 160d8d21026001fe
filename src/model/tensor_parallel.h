// The collectives a model shard needs inside its tensor-parallel group. The model depends only on
// this interface; the runtime implements it over MPI. Without a group (one rank holds every head,
// FFN column and vocabulary row) no collective is needed and the model skips them.
#pragma once

#include <cstddef>

namespace malleus::model {

template <typename T>
class TensorParallelGroup {
 public:
  virtual ~TensorParallelGroup() = default;
  virtual int size() const = 0;
  // In place, over all ranks of the group; every rank gets the same result.
  virtual void all_reduce_sum(T* data, size_t count) = 0;
  virtual void all_reduce_max(T* data, size_t count) = 0;
};

}  // namespace malleus::model
