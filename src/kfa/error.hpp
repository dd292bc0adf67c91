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
}  // namespace detail

}  // namespace kfa
