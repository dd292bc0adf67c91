// HDF5 round trip with kfa::io: every rank writes its zigzag shard of a [batch, seq, heads, d] tensor into
// one file (collectively, or through rank 0 with a serial HDF5), then reads a different sharding back.
//
//   mpirun -n P kfa_example_hdf5_roundtrip [file.h5]
#include <CLI/CLI.hpp>
#include <kfa/io/hdf5.hpp>

#include <cstdio>
#include <string>
#include <vector>

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank, p, status = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &p);
  std::string path = "kfa_roundtrip.h5";
  {  // Every rank parses the same command line and so ends the same way; rank 0 speaks.
    CLI::App app{
        "kfa HDF5 round trip: every rank writes its zigzag shard with kfa::io, then reads a contiguous "
        "sharding back",
        "kfa_example_hdf5_roundtrip"};
    app.add_option("file", path, "the HDF5 file written, read and removed")->capture_default_str();
    int exit_now = -1;
    try {
      app.parse(argc, argv);
      if (path.empty()) throw CLI::ValidationError("file", "needs a file name (got an empty string)");
    } catch (const CLI::ParseError& e) {
      exit_now = e.get_exit_code() == 0 ? 0 : 2;
      if (rank == 0 && exit_now == 0) app.exit(e);
      if (rank == 0 && exit_now == 2)
        std::fprintf(stderr, "kfa_example_hdf5_roundtrip: %s\nRun with --help for the options.\n", e.what());
    }
    if (exit_now >= 0) {
      MPI_Finalize();
      return exit_now;
    }
  }
  const long b = 2, seq = 101, h = 3, d = 8;
  auto value = [&](long bi, long i, long hi, long c) { return 1000.0 * bi + i + 0.01 * hi + 0.0001 * c; };
  try {
    {  // write: zigzag shards
      const auto segs = kfa::dist::shard_of(kfa::dist::Layout::zigzag, seq, p, rank);
      std::vector<double> mine;
      for (long bi = 0; bi < b; ++bi)
        for (const auto& s : segs)
          for (long i = s.global_begin; i < s.global_begin + s.length; ++i)
            for (long hi = 0; hi < h; ++hi)
              for (long c = 0; c < d; ++c) mine.push_back(value(bi, i, hi, c));
      kfa::io::Writer w(path, MPI_COMM_WORLD);  // a temporary file until commit()
      w.write_rows("x", {b, seq, h, d}, 1, segs, mine);
      w.attribute("note", "kfa HDF5 round trip");
      w.commit();  // renamed to `path` only now
    }
    // read back: contiguous shards
    kfa::io::Reader r(path, MPI_COMM_WORLD);
    const kfa::io::DatasetInfo info = r.info("x");
    const auto segs = kfa::dist::shard_of(kfa::dist::Layout::contiguous, seq, p, rank);
    std::vector<double> got;
    r.read_rows("x", info, segs, got);
    long bad = 0;
    size_t f = 0;
    for (long bi = 0; bi < b; ++bi)
      for (const auto& s : segs)
        for (long i = s.global_begin; i < s.global_begin + s.length; ++i)
          for (long hi = 0; hi < h; ++hi)
            for (long c = 0; c < d; ++c) bad += got[f++] != value(bi, i, hi, c);
    MPI_Allreduce(MPI_IN_PLACE, &bad, 1, MPI_LONG, MPI_SUM, MPI_COMM_WORLD);
    if (rank == 0)
      std::printf("kfa HDF5 round trip on %d ranks with %s: %ld mismatches: %s\n", p, kfa::io::io_mode(), bad,
                  bad == 0 ? "PASS" : "FAIL");
    status = bad == 0 ? 0 : 1;
  } catch (const kfa::Error& e) {
    if (rank == 0) std::fprintf(stderr, "%s\n", e.what());
    status = 2;
  }
  if (rank == 0) std::remove(path.c_str());
  MPI_Finalize();
  return status;
}
