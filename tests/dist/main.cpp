// GoogleTest main for MPI tests: MPI outlives Kokkos; the exit code is agreed over all ranks.
#include <gtest/gtest.h>
#include <mpi.h>

#include <Kokkos_Core.hpp>

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rc = 0;
  {
    ::testing::InitGoogleTest(&argc, argv);
    Kokkos::ScopeGuard guard(argc, argv);
    rc = RUN_ALL_TESTS();
  }
  MPI_Allreduce(MPI_IN_PLACE, &rc, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  MPI_Finalize();
  return rc;
}
