#pragma once
/// An MPI reduction that merges attention partials with the combine rule, so split-KV partials held on
/// different ranks can be combined with MPI_Reduce / MPI_Allreduce.
#include <mpi.h>

#include <kfa/error.hpp>
#include <kfa/online_softmax.hpp>

#include <type_traits>

namespace kfa {
namespace dist {

/// MPI datatype + operation over records of one query row: [O/ℓ (head_dim values), LSE] in Acc (float or
/// double). Not marked commutative, so MPI applies it in rank order and the result is reproducible.
/// Create and free it while MPI is initialized.
template <class Acc>
class MergeOp {
  static_assert(std::is_same<Acc, float>::value || std::is_same<Acc, double>::value, "MergeOp<float or double>");

 public:
  explicit MergeOp(int head_dim) : m_head_dim(head_dim) {
    if (head_dim < 1) kfa::detail::fail("kfa::dist::MergeOp: head_dim = ", head_dim, " (must be >= 1)");
    MPI_Type_contiguous(head_dim + 1, std::is_same<Acc, float>::value ? MPI_FLOAT : MPI_DOUBLE, &m_type);
    MPI_Type_commit(&m_type);
    MPI_Op_create(&MergeOp::apply, /*commute=*/0, &m_op);
  }
  ~MergeOp() {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized) return;
    MPI_Op_free(&m_op);
    MPI_Type_free(&m_type);
  }
  MergeOp(const MergeOp&) = delete;
  MergeOp& operator=(const MergeOp&) = delete;
  /// One record: head_dim + 1 values.
  MPI_Datatype datatype() const { return m_type; }
  MPI_Op op() const { return m_op; }
  int head_dim() const { return m_head_dim; }

 private:
  // inout ← merge(in, inout): `in` holds the lower ranks' partials.
  static void apply(void* in, void* inout, int* len, MPI_Datatype* type) {
    int bytes = 0;
    MPI_Type_size(*type, &bytes);
    const int n = bytes / static_cast<int>(sizeof(Acc));  // head_dim + 1
    const Acc* a = static_cast<const Acc*>(in);
    Acc* b = static_cast<Acc*>(inout);
    for (int r = 0; r < *len; ++r, a += n, b += n) {
      const LseMerge<Acc> m = merge_lse(a[n - 1], b[n - 1]);
      for (int c = 0; c < n - 1; ++c) b[c] = m.weight_a * a[c] + m.weight_b * b[c];
      b[n - 1] = m.lse;
    }
  }
  int m_head_dim;
  MPI_Datatype m_type;
  MPI_Op m_op;
};

}  // namespace dist
}  // namespace kfa
