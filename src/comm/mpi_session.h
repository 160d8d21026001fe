// Owns the process's MPI lifetime, so that main() of the CLI and of the MPI tests initializes
// MPI exactly once and finalizes it on every exit path (including an exception unwinding
// main), while code that runs inside a host that already initialized MPI leaves it alone.
#pragma once

namespace malleus::comm {

// Initializes MPI with MPI_THREAD_FUNNELED (only the main thread calls MPI; OpenMP worker
// threads never do) unless MPI is already initialized, and finalizes it on destruction only
// if this object initialized it. Communicators and requests still alive at that point are
// not freed by their destructors (MPI_Finalize releases them).
class MpiSession {
 public:
  MpiSession() : MpiSession(nullptr, nullptr) {}
  // argc/argv may be null; Open MPI does not need them.
  MpiSession(int* argc, char*** argv);
  ~MpiSession();
  MpiSession(const MpiSession&) = delete;
  MpiSession& operator=(const MpiSession&) = delete;
  MpiSession(MpiSession&&) = delete;
  MpiSession& operator=(MpiSession&&) = delete;

  // True between MPI_Init and MPI_Finalize: MPI calls are allowed.
  static bool initialized();
  // True if this object called MPI_Init and will call MPI_Finalize.
  bool owns() const { return owns_; }

 private:
  bool owns_ = false;
};

}  // namespace malleus::comm
