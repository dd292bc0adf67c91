// The tile product team_gemm (portable/tile_products.hpp) on host, every operand ending at a guard page: each
// shape the kernels use (A read row-major as K·Qᵀ does, or through its transpose as P·V does; n a multiple of 4,
// any m, any kdim), against a float64 product, every element checked. A read or write past an operand's last
// element is a segmentation fault here, whatever the heap around the kernels' tiles happens to hold (a loop one
// column long faults in every ISA). What the compiler makes of the product depends on where it is inlined: the
// GCC 12.2 over-read that micro_tile_scalar works around showed in the forward kernel's P·V (the rank-0 I/O app
// test, about one run in two) and in a standalone loop, not in these calls; this test guards kfa's own indexing.
#include "../common/kfa_test.hpp"

#include <kfa/detail/portable/tile_products.hpp>

#include <sys/mman.h>
#include <unistd.h>

#include <cmath>
#include <random>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

namespace {

/// `count` elements of E whose last one is the last before a page that may not be read or written.
template <class E>
class Guarded {
 public:
  explicit Guarded(long count) {
    const long page = sysconf(_SC_PAGESIZE);
    bytes_ = ((count * static_cast<long>(sizeof(E)) + page - 1) / page + 1) * page;
    void* m =
        mmap(nullptr, static_cast<std::size_t>(bytes_), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) throw std::runtime_error("Guarded: mmap failed");
    base_ = static_cast<char*>(m);
    char* guard = base_ + bytes_ - page;
    if (mprotect(guard, static_cast<std::size_t>(page), PROT_NONE) != 0) throw std::runtime_error("mprotect failed");
    data_ = reinterpret_cast<E*>(guard) - count;
  }
  ~Guarded() { munmap(base_, static_cast<std::size_t>(bytes_)); }
  Guarded(const Guarded&) = delete;
  Guarded& operator=(const Guarded&) = delete;
  E* data() const { return data_; }

 private:
  char* base_ = nullptr;
  long bytes_ = 0;
  E* data_ = nullptr;
};

using Exec = Kokkos::DefaultHostExecutionSpace;
using Member = typename Kokkos::TeamPolicy<Exec>::member_type;

template <class Acc>
void product(const Member& team, int m, int n, int kdim, const Acc* a, long a_rs, long a_cs, const Acc* b, int ldb,
             Acc* c, int ldc, bool accumulate) {
  kfa::detail::team_gemm<Exec>(team, m, n, kdim, a, a_rs, a_cs, b, ldb, c, ldc, accumulate);
}
// The forward's two calls as it makes them, the unit stride and `accumulate` constants at the call (what the
// compiler specializes on). O += P·V, P read through Sᵀ:
template <class Acc>
__attribute__((noinline)) void product_pv(const Member& team, int m, int n, int kdim, const Acc* st, long ld,
                                          const Acc* v, int ldv, Acc* o) {
  kfa::detail::team_gemm<Exec>(team, m, n, kdim, st, 1, ld, v, ldv, o, n, true);
}
// Sᵀ = K·Qᵀ:
template <class Acc>
__attribute__((noinline)) void product_s(const Member& team, int m, int n, int kdim, const Acc* k, long ldk,
                                         const Acc* qt, int ld, Acc* st, int lds) {
  kfa::detail::team_gemm<Exec>(team, m, n, kdim, k, ldk, 1, qt, ld, st, lds, false);
}

template <class Acc>
void check_shape(int m, int n, int kdim, bool transposed_a, bool accumulate, std::mt19937_64& rng) {
  const int pad = 3;  // leading dimensions a little past the extents, as the kernels' tiles have
  const long lda = transposed_a ? m + pad : kdim + pad;
  const long a_rs = transposed_a ? 1 : lda, a_cs = transposed_a ? lda : 1;
  const int ldb = n + 4, ldc = transposed_a ? n : n + 8;  // P·V writes O rows of d, K·Qᵀ Sᵀ rows of ld
  const long a_count = (m - 1) * a_rs + (kdim - 1) * a_cs + 1;
  const long b_count = static_cast<long>(kdim - 1) * ldb + n, c_count = static_cast<long>(m - 1) * ldc + n;
  Guarded<Acc> a(a_count), b(b_count), c(c_count);
  std::normal_distribution<double> normal(0.0, 1.0);
  for (long i = 0; i < a_count; ++i) a.data()[i] = static_cast<Acc>(normal(rng));
  for (long i = 0; i < b_count; ++i) b.data()[i] = static_cast<Acc>(normal(rng));
  for (long i = 0; i < c_count; ++i) c.data()[i] = accumulate ? static_cast<Acc>(normal(rng)) : NAN;
  std::vector<double> want(static_cast<std::size_t>(m) * n);
  for (int r = 0; r < m; ++r)
    for (int j = 0; j < n; ++j) {
      double sum = accumulate ? static_cast<double>(c.data()[r * ldc + j]) : 0.0;
      for (int kk = 0; kk < kdim; ++kk)
        sum += static_cast<double>(a.data()[r * a_rs + kk * a_cs]) * static_cast<double>(b.data()[kk * ldb + j]);
      want[static_cast<std::size_t>(r) * n + j] = sum;
    }

  const Acc* ap = a.data();
  const Acc* bp = b.data();
  Acc* cp = c.data();
  Kokkos::parallel_for(Kokkos::TeamPolicy<Exec>(1, Kokkos::AUTO), [=](const Member& team) {
    if (transposed_a && accumulate) product_pv(team, m, n, kdim, ap, lda, bp, ldb, cp);
    if (transposed_a && !accumulate) product(team, m, n, kdim, ap, 1, lda, bp, ldb, cp, ldc, false);
    if (!transposed_a && accumulate) product(team, m, n, kdim, ap, lda, 1, bp, ldb, cp, ldc, true);
    if (!transposed_a && !accumulate) product_s(team, m, n, kdim, ap, lda, bp, ldb, cp, ldc);
  });
  Kokkos::fence();

  const double tol = (std::is_same<Acc, float>::value ? 4e-6 : 1e-14) * (kdim + 1);
  int bad = 0;
  for (int r = 0; r < m; ++r)
    for (int j = 0; j < n; ++j) {
      const double got = static_cast<double>(c.data()[r * ldc + j]), ref = want[static_cast<std::size_t>(r) * n + j];
      if (!(std::fabs(got - ref) <= tol * (1.0 + std::fabs(ref))) && bad++ < 3)
        ADD_FAILURE() << "m " << m << " n " << n << " kdim " << kdim << (transposed_a ? " A transposed" : " A rows")
                      << (accumulate ? " accumulate" : "") << ": C(" << r << ", " << j << ") = " << got << ", float64 "
                      << ref;
    }
}

template <class Acc>
void check_all() {
  const std::uint64_t seed = kfa_test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (int m : {1, 2, 3, 4, 6, 8, 10, 12, 16, 30, 32})
    for (int n : {4, 8, 12, 16, 24, 32, 48, 64})
      for (int kdim : {1, 3, 8, 16, 37})
        for (bool transposed_a : {false, true})
          for (bool accumulate : {false, true}) check_shape<Acc>(m, n, kdim, transposed_a, accumulate, rng);
}

}  // namespace

TEST(TileProducts, FloatOperandsEndingAtAGuardPage) {
  check_all<float>();
}
TEST(TileProducts, DoubleOperandsEndingAtAGuardPage) {
  check_all<double>();
}
