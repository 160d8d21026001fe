// A stream of batches through three stages, the middle one on several threads, the output in the
// input's order: prepare-data reads documents on one thread, tokenizes them on `threads` threads
// and writes them in the order they were read, so its shards do not depend on the thread count.
#pragma once

#include <algorithm>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>

namespace malleus::data {

namespace ordered_detail {

// The state the three stages share; each stage is a method, run_ordered starts the threads.
template <typename Batch, typename Produce, typename Work>
class Stages {
 public:
  struct Slot {
    Batch batch;
    std::exception_ptr error;
    bool worked = false;
  };

  Stages(int in_flight, Produce& produce, Work& work)
      : in_flight_(in_flight), produce_(produce), work_(work) {}

  void producer() {
    for (int64_t seq = 0;; ++seq) {
      {
        std::unique_lock lock(mutex_);
        changed_.wait(lock, [&] { return stop_ || static_cast<int>(slots_.size()) < in_flight_; });
        if (stop_) return;
      }
      auto slot = std::make_unique<Slot>();
      bool more = false;
      std::exception_ptr error;
      try {
        more = produce_(slot->batch);
      } catch (...) {
        error = std::current_exception();
      }
      std::lock_guard lock(mutex_);
      if (!more) {
        produced_all_ = true;
        end_ = seq;
        produce_error_ = error;
        changed_.notify_all();
        return;
      }
      to_work_.push_back(slot.get());
      slots_.emplace(seq, std::move(slot));
      changed_.notify_all();
    }
  }

  void worker() {
    for (;;) {
      Slot* slot = nullptr;
      {
        std::unique_lock lock(mutex_);
        changed_.wait(lock, [&] { return stop_ || !to_work_.empty() || produced_all_; });
        if (stop_ || to_work_.empty()) return;
        slot = to_work_.front();
        to_work_.pop_front();
      }
      try {
        work_(slot->batch);
      } catch (...) {
        slot->error = std::current_exception();
      }
      std::lock_guard lock(mutex_);
      slot->worked = true;
      changed_.notify_all();
    }
  }

  // Batch `seq` once worked, or null after the last one; rethrows produce's exception in its place.
  std::unique_ptr<Slot> next(int64_t seq) {
    std::unique_lock lock(mutex_);
    changed_.wait(lock, [&] {
      const auto it = slots_.find(seq);
      return (it != slots_.end() && it->second->worked) || (produced_all_ && seq == end_);
    });
    if (produced_all_ && seq == end_) {
      if (produce_error_) std::rethrow_exception(produce_error_);
      return nullptr;
    }
    auto slot = std::move(slots_.extract(seq).mapped());
    changed_.notify_all();  // room for the producer
    return slot;
  }

  void stop() {
    {
      std::lock_guard lock(mutex_);
      stop_ = true;
    }
    changed_.notify_all();
  }

 private:
  const int in_flight_;
  Produce& produce_;
  Work& work_;
  std::mutex mutex_;
  std::condition_variable changed_;
  std::map<int64_t, std::unique_ptr<Slot>> slots_;  // produced, not yet consumed
  std::deque<Slot*> to_work_;                       // produced, not yet taken by a worker
  bool produced_all_ = false, stop_ = false;
  int64_t end_ = -1;  // the number of batches, once produce has returned false or thrown
  std::exception_ptr produce_error_;
};

}  // namespace ordered_detail

// produce(Batch&) fills a fresh batch and returns true, or returns false at the end; it runs on a
// thread of its own. work(Batch&) runs on `threads` threads, on any batch in any order.
// consume(Batch&) runs on the calling thread, on the batches in the order produce made them. At
// most `in_flight` batches (at least 1) are produced and not yet consumed, so memory stays bounded.
//
// With threads <= 1 all three run on the calling thread, one batch at a time.
//
// An exception from produce or work is rethrown here when consume reaches the batch it happened
// in, after every earlier batch was consumed; one from consume is rethrown at once. Either way
// every thread is joined first (each finishes the batch it holds).
template <typename Batch, typename Produce, typename Work, typename Consume>
void run_ordered(int threads, int in_flight, Produce&& produce, Work&& work, Consume&& consume) {
  if (threads <= 1) {
    for (;;) {
      Batch batch;
      if (!produce(batch)) return;
      work(batch);
      consume(batch);
    }
  }
  using StagesT = ordered_detail::Stages<Batch, std::remove_reference_t<Produce>,
                                         std::remove_reference_t<Work>>;
  StagesT stages(std::max(1, in_flight), produce, work);
  std::vector<std::thread> pool;
  // Stops and joins every thread however the consumer leaves.
  struct Joiner {
    StagesT& stages;
    std::vector<std::thread>& pool;
    ~Joiner() {
      stages.stop();
      for (auto& t : pool) t.join();
    }
  } joiner{stages, pool};
  pool.emplace_back([&] { stages.producer(); });
  for (int i = 0; i < threads; ++i) pool.emplace_back([&] { stages.worker(); });
  for (int64_t seq = 0;; ++seq) {
    const auto slot = stages.next(seq);
    if (!slot) return;
    if (slot->error) std::rethrow_exception(slot->error);
    consume(slot->batch);
  }
}

}  // namespace malleus::data
