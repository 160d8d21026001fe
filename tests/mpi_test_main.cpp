// main() for the tests that run under mpirun (malleus_add_mpi_test links it): every rank runs
// every test (they are collective); only rank 0 prints gtest's report, other ranks print their own
// failures; every rank exits non-zero if any rank failed, and rank 0 names the failing ranks.
#include <gtest/gtest.h>
#include <mpi.h>

#include <cstdio>
#include <string>
#include <vector>

#include "comm/mpi_session.h"

namespace {

// Prints this rank's failed assertions (ranks other than 0 have no gtest printer).
class RankFailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit RankFailurePrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const ::testing::TestPartResult& result) override {
    if (!result.failed()) return;
    std::fprintf(stderr, "[rank %d] %s:%d: Failure\n%s\n", rank_,
                 result.file_name() != nullptr ? result.file_name() : "unknown",
                 result.line_number(), result.summary());
    std::fflush(stderr);
  }

 private:
  int rank_;
};

}  // namespace

int main(int argc, char** argv) {
  malleus::comm::MpiSession session(&argc, &argv);
  ::testing::InitGoogleTest(&argc, argv);
  int rank = 0;
  int size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  ::testing::TestEventListeners& listeners = ::testing::UnitTest::GetInstance()->listeners();
  if (rank != 0) {
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new RankFailurePrinter(rank));
  }
  const int failed = RUN_ALL_TESTS() != 0 ? 1 : 0;
  std::vector<int> flags(static_cast<size_t>(size), 0);
  MPI_Gather(&failed, 1, MPI_INT, flags.data(), 1, MPI_INT, 0, MPI_COMM_WORLD);
  int any_failed = 0;
  MPI_Allreduce(&failed, &any_failed, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (rank == 0 && any_failed != 0) {
    std::string ranks;
    for (int r = 0; r < size; ++r) {
      if (flags[static_cast<size_t>(r)] == 0) continue;
      if (!ranks.empty()) ranks += ", ";
      ranks += std::to_string(r);
    }
    std::printf("failing exit on rank(s) %s of %d (each failure above names its rank)\n",
                ranks.c_str(), size);
  }
  return any_failed != 0 ? 1 : 0;
}
