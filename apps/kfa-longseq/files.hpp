#pragma once
// kfa-longseq: tensors between HDF5 files and the device, in blocks of at most a chunk of elements, so the
// host holds one block at a time (on host backends not even that where the types agree: HDF5 reads into
// and writes from the tensor's own memory).
#include "common.hpp"

#include <kfa/io/hdf5.hpp>

#include <algorithm>
#include <cstdlib>
#include <string>
#include <type_traits>
#include <vector>

namespace longseq {

/// Elements per I/O block: 2^26 (256 MiB of float32) unless KFA_LONGSEQ_IO_CHUNK (a test hook) says less.
inline std::size_t io_chunk_elements() {
  if (const char* e = std::getenv("KFA_LONGSEQ_IO_CHUNK")) {
    const long long v = std::atoll(e);
    if (v > 0) return static_cast<std::size_t>(v);
  }
  return std::size_t(1) << 26;
}

/// How many blocks every rank takes part in: the most any rank has. Collective.
inline std::size_t agreed_blocks(std::size_t mine, MPI_Comm comm) {
  unsigned long long n = mine;
  MPI_Allreduce(MPI_IN_PLACE, &n, 1, MPI_UNSIGNED_LONG_LONG, MPI_MAX, comm);
  return static_cast<std::size_t>(n);
}

/// Calls f(block) for each of this rank's blocks (row_blocks of its rows of a dataset with global `dims`,
/// io_chunk_elements() at most), then with empty blocks until it has made as many calls as the rank with
/// the most blocks: every block read or write is collective. Collective.
template <class F>
void for_each_block(const std::vector<long>& dims, const Shard& s, MPI_Comm comm, F&& f) {
  const auto blocks = kfa::io::row_blocks(dims, 1, s.segs, io_chunk_elements());
  const std::size_t count = agreed_blocks(blocks.size(), comm);
  for (std::size_t i = 0; i < count; ++i) f(i < blocks.size() ? blocks[i] : kfa::io::RowBlock());
}

/// Elements [offset, offset + n) of a device tensor as a flat View (LayoutRight: contiguous).
template <class T>
Kokkos::View<T*, Mem, Kokkos::MemoryTraits<Kokkos::Unmanaged>> flat_range(const Tensor<T>& x, std::size_t offset,
                                                                          std::size_t n) {
  return Kokkos::View<T*, Mem, Kokkos::MemoryTraits<Kokkos::Unmanaged>>(x.data() + offset, n);
}

/// Reads this rank's rows of dataset `name` into x [batch, n, heads, d] in T, block by block: HDF5 converts
/// from the file's type to M (T itself for float and double; for float16/bfloat16 float, or double from a
/// float64 file, then rounded to T on the host, as static_cast<T> of the file's value). Collective.
template <class T, class M>
void read_shard_as(kfa::io::Reader& reader, const std::string& name, const kfa::io::DatasetInfo& info, const Shard& s,
                   const Tensor<T>& x, MPI_Comm comm) {
  constexpr bool direct = std::is_same<T, M>::value && device_is_host;  // HDF5 reads into the tensor itself
  std::vector<M> buf;
  Kokkos::View<T*, Kokkos::HostSpace> stage;
  for_each_block(info.dims, s, comm, [&](const kfa::io::RowBlock& b) {
    if constexpr (direct) {
      reader.read_block(name, info, b, reinterpret_cast<M*>(x.data()) + b.offset);
      return;
    }
    buf.resize(b.elements);
    reader.read_block(name, info, b, buf.data());
    if (b.elements == 0) return;
    if (device_is_host) {
      T* dst = x.data() + b.offset;
      for (std::size_t j = 0; j < b.elements; ++j) dst[j] = static_cast<T>(buf[j]);
      return;
    }
    if (stage.extent(0) < b.elements)
      stage = Kokkos::View<T*, Kokkos::HostSpace>(
          Kokkos::view_alloc("kfa-longseq::read_stage", Kokkos::WithoutInitializing), b.elements);
    for (std::size_t j = 0; j < b.elements; ++j) stage(j) = static_cast<T>(buf[j]);
    Kokkos::deep_copy(flat_range(x, b.offset, b.elements),
                      Kokkos::subview(stage, std::make_pair(std::size_t(0), b.elements)));
  });
}

template <class T>
void read_shard(kfa::io::Reader& reader, const std::string& name, const kfa::io::DatasetInfo& info, const Shard& s,
                const Tensor<T>& x, MPI_Comm comm) {
  if constexpr (std::is_same<T, double>::value || std::is_same<T, float>::value) {
    read_shard_as<T, T>(reader, name, info, s, x, comm);
  } else if (info.type == kfa::io::FileType::float64) {
    read_shard_as<T, double>(reader, name, info, s, x, comm);
  } else {
    read_shard_as<T, float>(reader, name, info, s, x, comm);
  }
}

/// An output dtype's name and its element type in memory.
template <class Out>
kfa::io::FileType file_type_of() {
  return std::is_same<Out, double>::value  ? kfa::io::FileType::float64
         : std::is_same<Out, float>::value ? kfa::io::FileType::float32
                                           : kfa::io::FileType::float16;
}
template <class Out>
Out stored(double x) {
  if constexpr (std::is_same<Out, kfa::io::Float16>::value)
    return kfa::io::to_float16(x);
  else
    return static_cast<Out>(x);
}

/// Writes x [batch, n, heads, d] as this rank's rows of dataset `name` (global `dims`), stored as Out
/// (float64, float32 or float16, rounded to nearest), block by block: one block of the device tensor on the
/// host at a time, converted there. Collective.
template <class Out, class T>
void write_tensor(kfa::io::Writer& w, const std::string& name, const std::vector<long>& dims, const Shard& s,
                  const Tensor<T>& x, MPI_Comm comm) {
  w.create_dataset(name, dims, file_type_of<Out>());
  constexpr bool direct = std::is_same<T, Out>::value && device_is_host;  // HDF5 writes from the tensor itself
  std::vector<Out> buf;
  Kokkos::View<T*, Kokkos::HostSpace> stage;
  for_each_block(dims, s, comm, [&](const kfa::io::RowBlock& b) {
    if constexpr (direct) {
      w.write_block(name, b, reinterpret_cast<const Out*>(x.data()) + b.offset);
      return;
    }
    const T* src = x.data() + b.offset;
    if (!device_is_host && b.elements > 0) {
      if (stage.extent(0) < b.elements)
        stage = Kokkos::View<T*, Kokkos::HostSpace>(
            Kokkos::view_alloc("kfa-longseq::write_stage", Kokkos::WithoutInitializing), b.elements);
      Kokkos::deep_copy(Kokkos::subview(stage, std::make_pair(std::size_t(0), b.elements)),
                        flat_range(x, b.offset, b.elements));
      src = stage.data();
    }
    buf.resize(b.elements);
    for (std::size_t j = 0; j < b.elements; ++j) buf[j] = stored<Out>(to_double(src[j]));
    w.write_block(name, b, buf.data());
  });
}

/// Writes lse [batch, heads, n] as this rank's rows of dataset "lse" [batch, heads, seq], stored as Out
/// (float32 or float64). Small (1/head_dim of o): one host copy. Collective.
template <class Out, class A>
void write_lse(kfa::io::Writer& w, const Shard& s, const Kokkos::View<A***, Kokkos::LayoutRight, Mem>& lse) {
  auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), lse);
  std::vector<Out> out(h.data(), h.data() + h.size());
  w.write_rows("lse", {s.batch, s.heads, s.seq}, 2, s.segs, out);
}

}  // namespace longseq
