// kfa's scalar micro-tile (tile_products.hpp, micro_tile_scalar) as the forward's O += P·V calls it, A ending at
// a guard page. g++ 12.2 -O3 -march=native (or x86-64-v3/v4) reads past A and faults; with -DHIDE it does not.
// Build: g++ -O3 -march=x86-64-v3 [-DHIDE] overread.cpp -o overread && ./overread
#include <sys/mman.h>
#include <cstdio>
#include <cstring>
template <int RI, int RJ, class Acc>
inline void micro_tile_scalar(const Acc* a, long a_rs, long a_cs, const Acc* b, int ldb, Acc* c,
                                              int ldc, int kdim, bool accumulate) {
  Acc acc[RI][RJ];
  for (int r = 0; r < RI; ++r)
    for (int j = 0; j < RJ; ++j) acc[r][j] = accumulate ? c[r * ldc + j] : Acc(0);
  for (int kk = 0; kk < kdim; ++kk) {
    const Acc* brow = b + static_cast<long>(kk) * ldb;
    const Acc* acol = a + kk * a_cs;
#ifdef HIDE
    __asm__("" : "+r"(acol));  // kfa's fix (tile_products.hpp, micro_tile_scalar)
#endif
    for (int r = 0; r < RI; ++r) {
      const Acc av = acol[r * a_rs];
      for (int j = 0; j < RJ; ++j) acc[r][j] += av * brow[j];
    }
  }
  for (int r = 0; r < RI; ++r)
    for (int j = 0; j < RJ; ++j) c[r * ldc + j] = acc[r][j];
}
template <int RI, int RJ, class Acc>
__attribute__((noinline)) void gemm_fixed(int m, int n, int kdim, const Acc* a, long a_rs, long a_cs, const Acc* b, int ldb, Acc* c, int ldc, bool accumulate) {
  const int tiles_j = n / RJ, tiles = (m / RI) * tiles_j;
  for (int t = 0; t < tiles; ++t) {
    int i0 = (t / tiles_j) * RI, j0 = (t % tiles_j) * RJ;
    micro_tile_scalar<RI, RJ>(a + i0 * a_rs, a_rs, a_cs, b + j0, ldb, c + i0 * ldc + j0, ldc, kdim, accumulate);
  }
}
__attribute__((noinline)) void pv(int m, int d, int cols, const float* st, int ld, const float* vp, int ldv, float* ot) {
  gemm_fixed<4, 8>(m, d, cols, st, 1, ld, vp, ldv, ot, d, true);
}
int main() {
  const long page = 4096;
  char* mem = (char*)mmap(nullptr, 2 * page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  mprotect(mem + page, page, PROT_NONE);
  const int ld = 32, kdim = 8;
  float* a = (float*)(mem + page) - (kdim - 1) * ld - 16;
  for (int i = 0; i < (kdim - 1) * ld + 16; ++i) a[i] = 1.0f;
  float b[8 * 16], c[16 * 8];
  for (auto& x : b) x = 2.0f;
  memset(c, 0, sizeof c);
  pv(16, 8, kdim, a, ld, b, 16, c);
  printf("ok %g\n", c[0]);
}
