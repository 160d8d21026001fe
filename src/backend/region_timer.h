// Times a region of a backend's compute as its device sees it: what the engine measures for the
// straggler monitor (the compute between communications). The CPU backend's is the host's steady
// clock; a GPU's records events on the backend's stream and reads them once the device has
// reached them (src/backend/cuda/cuda_timer.cu), so work still queued is counted, not just its
// launch.
#pragma once

#include <chrono>

namespace malleus::backend {

class RegionTimer {
 public:
  virtual ~RegionTimer() = default;
  // Starts a region (after the work issued so far).
  virtual void begin() = 0;
  // Seconds from begin() to the end of the work issued so far, waiting for it; may be called
  // several times in one region.
  virtual double elapsed() = 0;
  // Waits for the work issued so far (nothing to wait for on the CPU): called before timing a
  // wait inside a region (a tensor-parallel collective), so that the device's compute still
  // queued is not counted as waiting.
  virtual void settle() {}
  // Keeps the device computing for `seconds` of its own clock, after the work issued so far: an
  // injected straggler's extra work (runtime/engine.h), which this timer counts like any other.
  // Busy work, not a sleep: a sleeping CPU rank would hand its core to the others.
  virtual void keep_busy(double seconds) = 0;
};

// The host's steady clock: right for a backend whose calls return when their work is done.
class SteadyClockTimer final : public RegionTimer {
 public:
  void begin() override { start_ = std::chrono::steady_clock::now(); }
  double elapsed() override {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  }
  void keep_busy(double seconds) override {
    const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
    volatile double sink = 0;
    while (std::chrono::steady_clock::now() < until) {
      for (int i = 0; i < 1024; ++i) sink = sink + 1.0;
    }
  }

 private:
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
};

}  // namespace malleus::backend
