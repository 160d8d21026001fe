// The main of an MPI benchmark program: MPI started, `run` on every rank, and an error on any rank
// printed with its rank and ending the whole job (the other ranks would wait for it forever).
#pragma once

#include <cstdio>
#include <exception>

#include "comm/communicator.h"
#include "comm/mpi_session.h"

namespace malleus::bench {

// `run(world, argc, argv)` sees the arguments left after MPI's own.
template <typename Run>
int mpi_main(int argc, char** argv, Run run) {
  comm::MpiSession session(&argc, &argv);
  comm::Communicator world = comm::Communicator::world();
  try {
    run(world, argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: [rank %d] %s\n", world.rank(), e.what());
    std::fflush(stderr);
    world.abort(1);
  }
  return 0;
}

}  // namespace malleus::bench
