#pragma once
#include <sstream>
#include <stdexcept>
#include <string>

namespace kfa {

/// Thrown for bad arguments; the message names the function, the argument and the values.
class Error : public std::invalid_argument {
 public:
  explicit Error(const std::string& what) : std::invalid_argument(what) {}
};

namespace detail {
/// Builds an error message from streamable pieces: fail("kfa::f: ", "k.extent(3) = ", 96, ...).
template <class... Args>
[[noreturn]] void fail(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  throw Error(os.str());
}

/// The league (or grid) size of a launch as the int Kokkos and CUDA take, or an Error
/// "<fn>: <what> = <league> exceeds 2^31 - 1". The attention kernels' launches (team policies and native grids)
/// size their league here.
inline int checked_league(const char* fn, const char* what, long league) {
  if (league > 2147483647L) fail(fn, ": ", what, " = ", league, " exceeds 2^31 - 1");
  return static_cast<int>(league);
}
}  // namespace detail

}  // namespace kfa
