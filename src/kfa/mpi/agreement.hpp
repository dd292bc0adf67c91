#pragma once
/// kfa/mpi/agreement.hpp (namespace kfa::dist) — one collective decision about a failure, for every layer that calls
/// MPI collectives: each rank says what failed on it ("" when nothing did), and then either every rank returns or every
/// rank throws the same kfa::Error, naming the first failing rank's message. No rank is left waiting in a later
/// collective call while another has thrown. The ring agrees this way on its argument checks and at the end of
/// every ring step; kfa::io on every file operation.
#include <mpi.h>

#include <kfa/error.hpp>

#include <array>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <exception>
#include <stdexcept>
#include <string>
#include <vector>

namespace kfa {
namespace dist {

/// Throws std::runtime_error "kfa::dist: <call> failed: <MPI's error string>" unless `rc` is MPI_SUCCESS.
inline void check_mpi(int rc, const char* call) {
  if (rc != MPI_SUCCESS) {
    char msg[MPI_MAX_ERROR_STRING];
    int len = 0;
    MPI_Error_string(rc, msg, &len);
    throw std::runtime_error(std::string("kfa::dist: ") + call + " failed: " + std::string(msg, len));
  }
}

/// Longest failure message that reaches the other ranks (longer ones are cut there).
constexpr int max_agreed_message = 1023;

namespace detail {

/// The lowest-numbered rank whose local error is not empty (`rank` −1 when no rank's is), and its message.
struct FirstFailure {
  int rank = -1;
  int size = 1;
  std::string message;
};

/// Collective over comm: one MPI_Allreduce of a flag, and only when some rank failed an MPI_Allgather of
/// every rank's message (the first max_agreed_message characters of it).
inline FirstFailure first_failure(MPI_Comm comm, const std::string& local_error) {
  FirstFailure f;
  check_mpi(MPI_Comm_size(comm, &f.size), "MPI_Comm_size");
  int mine = local_error.empty() ? 0 : 1, any = 0;
  check_mpi(MPI_Allreduce(&mine, &any, 1, MPI_INT, MPI_MAX, comm), "MPI_Allreduce");
  if (!any) return f;
  constexpr int cap = max_agreed_message + 1;
  std::array<char, cap> msg{};
  std::snprintf(msg.data(), cap, "%s", local_error.c_str());
  std::vector<char> all(static_cast<std::size_t>(cap) * f.size);
  check_mpi(MPI_Allgather(msg.data(), cap, MPI_CHAR, all.data(), cap, MPI_CHAR, comm), "MPI_Allgather");
  for (int r = 0; r < f.size; ++r) {
    const char* m = all.data() + static_cast<std::size_t>(r) * cap;
    if (m[0] != '\0') {
      f.rank = r;
      f.message.assign(m, strnlen(m, cap));
      return f;
    }
  }
  return f;
}

/// Runs `body` and returns its exception's message ("" when it returned): work whose failure must reach an
/// agreement instead of leaving the other ranks waiting.
template <class F>
std::string capture(F&& body) {
  try {
    body();
  } catch (const std::exception& e) {  // kfa::Error, and MPI/CUDA/NCCL/HDF5 failures
    return e.what()[0] ? e.what() : "unknown error";
  } catch (...) {
    return "unknown exception";
  }
  return "";
}

}  // namespace detail

/// Every rank throws, as kfa::Error, the message of the first rank whose `local_error` is not empty (its
/// first max_agreed_message characters); when all are empty every rank returns. Use it to turn a decision
/// one rank makes (a failed check, a file that cannot be written) into one every rank takes alike, so that
/// none is left waiting in a later collective call. Collective over comm.
inline void agree(MPI_Comm comm, const std::string& local_error) {
  const detail::FirstFailure f = detail::first_failure(comm, local_error);
  if (f.rank >= 0) throw kfa::Error(f.message);
}

/// As agree(comm, local_error), naming the failing rank: every rank throws
/// "<context>rank <r> of <P>: <rank r's message>". Collective over comm.
inline void agree(MPI_Comm comm, const std::string& local_error, const std::string& context) {
  const detail::FirstFailure f = detail::first_failure(comm, local_error);
  if (f.rank >= 0) kfa::detail::fail(context, "rank ", f.rank, " of ", f.size, ": ", f.message);
}

}  // namespace dist
}  // namespace kfa
