// MPI initialization and finalization for MpiSession; see mpi_session.h.
#include "comm/mpi_session.h"

#include <mpi.h>

#include <string>

#include "common/error.h"

namespace malleus::comm {

bool MpiSession::initialized() {
  int initialized = 0;
  int finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  return initialized != 0 && finalized == 0;
}

MpiSession::MpiSession(int* argc, char*** argv) {
  int already = 0;
  int finalized = 0;
  MPI_Initialized(&already);
  MPI_Finalized(&finalized);
  check(finalized == 0, "MpiSession: MPI was already finalized and cannot be initialized again");
  if (already != 0) return;
  int provided = MPI_THREAD_SINGLE;
  const int rc = MPI_Init_thread(argc, argv, MPI_THREAD_FUNNELED, &provided);
  check(rc == MPI_SUCCESS, "MpiSession: MPI_Init_thread failed (error " + std::to_string(rc) + ")");
  if (provided < MPI_THREAD_FUNNELED) {
    MPI_Finalize();
    throw Error("MpiSession: the MPI library does not provide MPI_THREAD_FUNNELED (provided " +
                std::to_string(provided) + ")");
  }
  owns_ = true;
}

MpiSession::~MpiSession() {
  if (owns_ && initialized()) MPI_Finalize();
}

}  // namespace malleus::comm
