#pragma once
/// kfa::io — sharded HDF5 I/O for sequence-parallel runs. With a parallel HDF5 every rank reads and writes
/// its own rows through collective MPI-IO hyperslab selections; with a serial HDF5 (as on machines whose
/// HDF5 has no MPI) rank 0 does the file I/O and scatters/gathers the rows. Tensors are [batch, seq, heads,
/// head_dim] (sharded along seq) or [batch, heads, seq] (LSE, sharded along seq). A rank's rows move whole
/// (read_rows / write_rows) or in blocks of bounded size (row_blocks, read_block / write_block: one block
/// of a device tensor on the host at a time), converted by HDF5 to and from float or double in memory, or
/// stored from Float16 (float16 rounded to nearest as numpy rounds).
#include <hdf5.h>
#include <mpi.h>

#include <kfa/error.hpp>
#include <kfa/mpi/agreement.hpp>
#include <kfa/mpi/shard.hpp>

#include <kfa/io/files.hpp>

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <map>
#include <string>
#include <type_traits>
#include <vector>

// Parallel I/O when the HDF5 library has MPI-IO, unless KFA_IO_FORCE_SERIAL asks for the rank-0 path
// (which is what a serial HDF5 gets; the tests use it to exercise that path with any HDF5).
#if defined(H5_HAVE_PARALLEL) && !defined(KFA_IO_FORCE_SERIAL)
#define KFA_IO_PARALLEL 1
#endif

namespace kfa {
namespace io {

/// True when this build's HDF5 has MPI-IO (collective parallel I/O); false: rank-0 I/O.
constexpr bool parallel_hdf5() {
#ifdef KFA_IO_PARALLEL
  return true;
#else
  return false;
#endif
}
inline const char* io_mode() {
  return parallel_hdf5() ? "parallel HDF5 (collective MPI-IO)" : "serial HDF5 (rank-0 I/O)";
}

/// "4.1.4" (Open MPI) or the MPI standard version ("3.1") of other MPIs: for messages and reports.
inline std::string mpi_library_version() {
#ifdef OMPI_MAJOR_VERSION
  return std::to_string(OMPI_MAJOR_VERSION) + "." + std::to_string(OMPI_MINOR_VERSION) + "." +
         std::to_string(OMPI_RELEASE_VERSION);
#else
  return std::to_string(MPI_VERSION) + "." + std::to_string(MPI_SUBVERSION);
#endif
}

/// The HDF5 library's version at run time ("1.10.8").
inline std::string hdf5_library_version() {
  unsigned maj = 0, min = 0, rel = 0;
  H5get_libversion(&maj, &min, &rel);
  return std::to_string(maj) + "." + std::to_string(min) + "." + std::to_string(rel);
}

/// Longest path (in characters, as handed to MPI_File_open) that this MPI's MPI-IO opens without aborting
/// the job, for a communicator of `comm_size` ranks; 0: no limit known. Open MPI before 5.0 queries its
/// "lockedfile" shared file-pointer component on every MPI_File_open, which writes
/// `<path>.locktest.<rank>` into a 256-byte stack buffer (sprintf): a longer path is a buffer overflow and
/// SIGABRT inside MPI. Not a limit when that component is deselected (OMPI_MCA_sharedfp, as `mpirun --mca
/// sharedfp ^lockedfile` sets it; see avoid_shared_file_pointer_components()) or when I/O is serial.
inline std::size_t mpi_io_path_limit(int comm_size) {
#if defined(KFA_IO_PARALLEL) && defined(OMPI_MAJOR_VERSION) && OMPI_MAJOR_VERSION < 5
  if (const char* sel = std::getenv("OMPI_MCA_sharedfp")) {
    const std::string v(sel);
    const bool listed = v.find("lockedfile") != std::string::npos;
    if (!v.empty() && (v[0] == '^' ? listed : !listed)) return 0;  // lockedfile excluded / not included
  }
  const std::size_t digits = std::to_string(comm_size > 0 ? comm_size - 1 : 0).size();
  return 256 - 1 - std::strlen(".locktest.") - digits;
#else
  (void)comm_size;
  return 0;
#endif
}

/// "" when MPI-IO can open `path` (mpi_io_path_limit), else a message naming the length, the limit and
/// what to do; `option` names the path for the user ("--input").
inline std::string mpi_io_path_problem(const std::string& option, const std::string& path, int comm_size) {
  const std::size_t limit = mpi_io_path_limit(comm_size);
  if (limit == 0 || path.size() <= limit) return "";
  return "kfa::io: " + option + ": the path " + path + " has " + std::to_string(path.size()) +
         " characters, but Open MPI " + mpi_library_version() + " aborts MPI_File_open on paths longer than " +
         std::to_string(limit) + " (its 'lockedfile' shared file-pointer component appends '.locktest.<rank>' in a " +
         "256-byte buffer); use a shorter path (a relative one counts as given) or deselect that component " +
         "(mpirun --mca sharedfp ^lockedfile, or OMPI_MCA_sharedfp=^lockedfile); nothing was read or written";
}

/// For programs that never use MPI shared file pointers (kfa::io does not): deselects Open MPI's
/// "lockedfile" shared file-pointer component, unless the user chose (OMPI_MCA_sharedfp is set), so paths
/// of any legal length open (mpi_io_path_limit). Open MPI 4.1 needs some component to open a file at all:
/// "sm" remains (its files live in Open MPI's session directory) and "individual" where sm cannot run
/// (ranks on several nodes; it writes `<file>.data.<rank>` beside a file opened for writing, removed at
/// close). Call before MPI_Init; a no-op for other MPIs.
inline void avoid_shared_file_pointer_components() {
#ifdef OMPI_MAJOR_VERSION
  ::setenv("OMPI_MCA_sharedfp", "^lockedfile", 0);
#endif
}

/// An IEEE 754 binary16 value (float16) as a file stores it: what numpy's float16 and h5py write.
struct Float16 {
  std::uint16_t bits = 0;
};

/// `x` rounded to the nearest float16, ties to even (numpy's astype(float16)): beyond the largest float16
/// (65504) ±Inf, below half the smallest subnormal ±0, NaN stays NaN. (HDF5's own float-to-half conversion
/// truncates at the top of the range: 65520 becomes 65504, not Inf.)
inline Float16 to_float16(double x) {
  std::uint64_t u;
  std::memcpy(&u, &x, sizeof u);
  const std::uint16_t sign = static_cast<std::uint16_t>((u >> 48) & 0x8000u);
  const int exp = static_cast<int>((u >> 52) & 0x7ff);
  const std::uint64_t man = u & 0xFFFFFFFFFFFFFULL;
  Float16 h;
  if (exp == 0x7ff) {  // Inf or NaN (a quiet NaN keeps a mantissa bit)
    h.bits = static_cast<std::uint16_t>(sign | 0x7c00u | (man ? 0x200u : 0u));
    return h;
  }
  const int e = exp - 1023 + 15;  // the float16 biased exponent
  std::uint64_t keep, rest, half;
  if (e >= 31) {
    h.bits = static_cast<std::uint16_t>(sign | 0x7c00u);
    return h;
  }
  if (e >= 1) {  // normal: drop 42 of the 52 mantissa bits; a carry runs into the exponent (65520 -> Inf)
    keep = (static_cast<std::uint64_t>(e) << 10) | (man >> 42);
    rest = man & ((1ULL << 42) - 1), half = 1ULL << 41;
  } else {                         // subnormal: the value in units of 2^-24
    const int shift = 1051 - exp;  // >= 43
    if (exp == 0 || shift > 54) {  // below 2^-25 (or a double subnormal): rounds to zero
      h.bits = sign;
      return h;
    }
    const std::uint64_t m = man | (1ULL << 52);
    keep = m >> shift, rest = m & ((1ULL << shift) - 1), half = 1ULL << (shift - 1);
  }
  if (rest > half || (rest == half && (keep & 1))) ++keep;
  h.bits = static_cast<std::uint16_t>(sign | keep);
  return h;
}

/// A block of a [.., seq, ..] dataset that one rank reads or writes in one call: the hyperslab `start` +
/// `count` (one index of every dimension before seq_dim, a run of tokens of one segment, all of every later
/// dimension), and where its elements lie, contiguous, in the rank's local row-major array [.., n_local, ..]
/// (`offset`, `elements`). A block with `elements` 0 selects nothing (a rank with fewer blocks than another
/// still takes part in every collective call).
struct RowBlock {
  std::vector<long> start, count;
  std::size_t offset = 0, elements = 0;
  int seq_dim = 1;
};

/// The rank's rows `segs` (along `seq_dim` of a dataset with global `dims`) cut into blocks of at most
/// `max_elements` elements (at least one token each), in local memory order.
inline std::vector<RowBlock> row_blocks(const std::vector<long>& dims, int seq_dim,
                                        const std::vector<kfa::dist::Segment>& segs, std::size_t max_elements) {
  std::size_t outer = 1, inner = 1;
  for (int i = 0; i < seq_dim; ++i) outer *= static_cast<std::size_t>(dims[i]);
  for (std::size_t i = static_cast<std::size_t>(seq_dim) + 1; i < dims.size(); ++i)
    inner *= static_cast<std::size_t>(dims[i]);
  long n = 0;
  for (const auto& s : segs) n += s.length;
  const long step = static_cast<long>(std::max<std::size_t>(1, inner == 0 ? 1 : max_elements / inner));
  std::vector<RowBlock> out;
  if (inner == 0) return out;
  for (std::size_t o = 0; o < outer; ++o)
    for (const auto& s : segs)
      for (long t = 0; t < s.length; t += step) {
        RowBlock b;
        b.seq_dim = seq_dim;
        b.start.assign(dims.size(), 0), b.count.assign(dims.begin(), dims.end());
        std::size_t rest = o;
        for (int i = seq_dim - 1; i >= 0; --i)
          b.start[i] = static_cast<long>(rest % static_cast<std::size_t>(dims[i])), b.count[i] = 1,
          rest /= static_cast<std::size_t>(dims[i]);
        b.start[seq_dim] = s.global_begin + t;
        b.count[seq_dim] = std::min(step, s.length - t);
        b.offset = (o * static_cast<std::size_t>(n) + static_cast<std::size_t>(s.local_begin + t)) * inner;
        b.elements = static_cast<std::size_t>(b.count[seq_dim]) * inner;
        out.push_back(b);
      }
  return out;
}

/// Element type of a dataset in the file.
enum class FileType { float64, float32, float16, other };
inline const char* to_string(FileType t) {
  switch (t) {
    case FileType::float64:
      return "float64";
    case FileType::float32:
      return "float32";
    case FileType::float16:
      return "float16";
    default:
      return "unsupported";
  }
}

struct DatasetInfo {
  bool exists = false;
  FileType type = FileType::other;
  std::vector<long> dims;
  std::string type_text;  // the file's element type in words ("float32", "integer (4 bytes)", "compound ...")
};

namespace detail {
struct Handle {  // closes an HDF5 id with the right call
  hid_t id = -1;
  herr_t (*close)(hid_t) = nullptr;
  Handle() = default;
  Handle(hid_t i, herr_t (*c)(hid_t)) : id(i), close(c) {}
  Handle(const Handle&) = delete;
  Handle& operator=(const Handle&) = delete;
  Handle(Handle&& o) noexcept : id(o.id), close(o.close) { o.id = -1; }
  Handle& operator=(Handle&& o) noexcept {
    reset();
    id = o.id, close = o.close, o.id = -1;
    return *this;
  }
  ~Handle() { reset(); }
  void reset() {
    if (id >= 0 && close) close(id);
    id = -1;
  }
  operator hid_t() const { return id; }
};

inline hid_t check(hid_t id, const std::string& what) {
  if (id < 0) kfa::detail::fail("kfa::io: ", what, " failed");
  return id;
}

inline FileType classify(hid_t type) {
  if (H5Tget_class(type) != H5T_FLOAT) return FileType::other;
  const size_t sz = H5Tget_size(type);
  return sz == 8 ? FileType::float64 : sz == 4 ? FileType::float32 : sz == 2 ? FileType::float16 : FileType::other;
}

/// The element type in words, for messages: "float32", "integer (4 bytes)", "compound (16 bytes: a complex number?)".
inline std::string type_text(hid_t type) {
  const H5T_class_t c = H5Tget_class(type);
  const size_t sz = H5Tget_size(type);
  const FileType t = classify(type);
  if (t != FileType::other) return to_string(t);
  const char* name = c == H5T_INTEGER     ? "integer"
                     : c == H5T_FLOAT     ? "float"
                     : c == H5T_STRING    ? "string"
                     : c == H5T_BITFIELD  ? "bitfield"
                     : c == H5T_OPAQUE    ? "opaque"
                     : c == H5T_COMPOUND  ? "compound"
                     : c == H5T_REFERENCE ? "reference"
                     : c == H5T_ENUM      ? "enum"
                     : c == H5T_VLEN      ? "variable-length"
                     : c == H5T_ARRAY     ? "array"
                                          : "unknown";
  std::string out = std::string(name) + " (" + std::to_string(sz) + " bytes";
  if (c == H5T_COMPOUND && H5Tget_nmembers(type) == 2) out += ": a complex number?";
  return out + ")";
}

/// " (an external link to FILE:/PATH)", " (a soft link to /PATH)" or "" (a hard link or no link): where a
/// name leads, for messages about an object that cannot be opened.
inline std::string link_text(hid_t file, const std::string& name) {
#if H5_VERSION_GE(1, 12, 0)
  H5L_info2_t li;
  if (H5Lget_info2(file, name.c_str(), &li, H5P_DEFAULT) < 0) return "";
#else
  H5L_info_t li;
  if (H5Lget_info(file, name.c_str(), &li, H5P_DEFAULT) < 0) return "";
#endif
  if (li.type != H5L_TYPE_EXTERNAL && li.type != H5L_TYPE_SOFT) return "";
  std::vector<char> buf(li.u.val_size + 1, 0);
  if (H5Lget_val(file, name.c_str(), buf.data(), buf.size(), H5P_DEFAULT) < 0) return "";
  if (li.type == H5L_TYPE_SOFT) return " (a soft link to " + std::string(buf.data()) + ")";
  unsigned flags = 0;
  const char *target_file = nullptr, *target_path = nullptr;
  if (H5Lunpack_elink_val(buf.data(), li.u.val_size, &flags, &target_file, &target_path) < 0)
    return " (an external link)";
  return " (an external link to " + std::string(target_file ? target_file : "?") + ":" +
         std::string(target_path ? target_path : "?") + ")";
}

/// `segs` in the order HDF5 walks the union of their rows (by global position), their local_begin counted
/// in that order; `places` the same with `segs`' order kept (where each one's rows go in that order).
inline std::vector<kfa::dist::Segment> in_file_order(const std::vector<kfa::dist::Segment>& segs,
                                                     std::vector<kfa::dist::Segment>* places = nullptr) {
  std::vector<std::size_t> at(segs.size());
  for (std::size_t i = 0; i < at.size(); ++i) at[i] = i;
  std::stable_sort(at.begin(), at.end(),
                   [&](std::size_t a, std::size_t b) { return segs[a].global_begin < segs[b].global_begin; });
  std::vector<kfa::dist::Segment> sorted, placed(segs);
  long local = 0;
  for (const std::size_t i : at) {
    placed[i].local_begin = local, local += segs[i].length;
    sorted.push_back(placed[i]);
  }
  if (places) *places = placed;
  return sorted;
}

/// `data` (rows along dimension seq_dim of `dims`, whose other extents count, laid out as the segments `from`
/// say) laid out as `to` says: the same segments in the same order, with other local_begin.
template <class T>
std::vector<T> moved_rows(const std::vector<T>& data, const std::vector<long>& dims, int seq_dim,
                          const std::vector<kfa::dist::Segment>& from, const std::vector<kfa::dist::Segment>& to) {
  long outer = 1, inner = 1, n = 0;
  for (int i = 0; i < seq_dim; ++i) outer *= dims[i];
  for (std::size_t i = seq_dim + 1; i < dims.size(); ++i) inner *= dims[i];
  for (const auto& x : from) n += x.length;
  std::vector<T> out(data.size());
  for (long o = 0; o < outer; ++o)
    for (std::size_t i = 0; i < from.size(); ++i)
      std::copy_n(data.begin() + (o * n + from[i].local_begin) * inner, from[i].length * inner,
                  out.begin() + (o * n + to[i].local_begin) * inner);
  return out;
}

inline bool same_places(const std::vector<kfa::dist::Segment>& a, const std::vector<kfa::dist::Segment>& b) {
  for (std::size_t i = 0; i < a.size(); ++i)
    if (a[i].length > 0 && a[i].local_begin != b[i].local_begin) return false;
  return true;
}

/// Selects the union of `segs` along dimension `seq_dim` of a dataspace with `dims` (HDF5 walks it in the
/// order of global positions: in_file_order).
inline void select_rows(hid_t space, const std::vector<long>& dims, int seq_dim,
                        const std::vector<kfa::dist::Segment>& segs) {
  H5Sselect_none(space);
  for (const auto& s : segs) {
    if (s.length == 0) continue;
    std::vector<hsize_t> start(dims.size(), 0), count(dims.begin(), dims.end());
    start[seq_dim] = static_cast<hsize_t>(s.global_begin);
    count[seq_dim] = static_cast<hsize_t>(s.length);
    H5Sselect_hyperslab(space, H5S_SELECT_OR, start.data(), nullptr, count.data(), nullptr);
  }
}

inline Handle file_access(MPI_Comm comm) {
  Handle fapl(H5Pcreate(H5P_FILE_ACCESS), H5Pclose);
#ifdef KFA_IO_PARALLEL
  H5Pset_fapl_mpio(fapl, comm, MPI_INFO_NULL);
#else
  (void)comm;
#endif
  return fapl;
}
/// Collective MPI-IO transfers, or independent ones (`collective` false: each rank writes its own rows, so
/// a write that fails on one rank returns there instead of leaving the others inside MPI-IO's collective).
inline Handle transfer(bool collective = true) {
  Handle dxpl(H5Pcreate(H5P_DATASET_XFER), H5Pclose);
#ifdef KFA_IO_PARALLEL
  H5Pset_dxpl_mpio(dxpl, collective ? H5FD_MPIO_COLLECTIVE : H5FD_MPIO_INDEPENDENT);
#else
  (void)collective;
#endif
  return dxpl;
}

/// Dataset creation: storage allocated when the dataset is created (parallel HDF5 always does; the serial
/// driver would wait for the first write), so the Writer knows where it lies before writing into it. Nothing
/// is written then (no fill value is set).
inline Handle early_allocation() {
  Handle dcpl(H5Pcreate(H5P_DATASET_CREATE), H5Pclose);
  H5Pset_alloc_time(dcpl, H5D_ALLOC_TIME_EARLY);
  return dcpl;
}

/// IEEE binary16 as h5py writes it (HDF5 1.10 has no predefined float16 type).
inline Handle float16_type() {
  Handle t(H5Tcopy(H5T_IEEE_F32LE), H5Tclose);
  H5Tset_fields(t, 15, 10, 5, 0, 10);
  H5Tset_size(t, 2);
  H5Tset_ebias(t, 15);
  return t;
}
/// The HDF5 type of elements of type M in memory: float, double or Float16.
template <class M>
Handle memory_type() {
  static_assert(std::is_same<M, float>::value || std::is_same<M, double>::value || std::is_same<M, Float16>::value,
                "kfa::io: elements in memory are float, double or kfa::io::Float16");
  if (std::is_same<M, Float16>::value) return float16_type();
  return Handle(H5Tcopy(std::is_same<M, double>::value ? H5T_NATIVE_DOUBLE : H5T_NATIVE_FLOAT), H5Tclose);
}
inline Handle file_type(FileType t) {
  if (t == FileType::float16) return float16_type();
  if (t == FileType::float64) return Handle(H5Tcopy(H5T_IEEE_F64LE), H5Tclose);
  if (t == FileType::float32) return Handle(H5Tcopy(H5T_IEEE_F32LE), H5Tclose);
  kfa::detail::fail("kfa::io: datasets are stored as float64, float32 or float16");
}

/// Selects `b` in a dataspace of the file (nothing for an empty block).
inline void select_block(hid_t space, const RowBlock& b) {
  if (b.elements == 0) {
    H5Sselect_none(space);
    return;
  }
  std::vector<hsize_t> start(b.start.begin(), b.start.end()), count(b.count.begin(), b.count.end());
  H5Sselect_hyperslab(space, H5S_SELECT_SET, start.data(), nullptr, count.data(), nullptr);
}
/// The memory dataspace of `b`: its elements, contiguous (nothing selected for an empty block).
inline Handle block_memory_space(const RowBlock& b) {
  const hsize_t n = b.elements > 0 ? static_cast<hsize_t>(b.elements) : 1;
  Handle m(H5Screate_simple(1, &n, nullptr), H5Sclose);
  if (b.elements == 0) H5Sselect_none(m);
  return m;
}
/// "rows 32..63" along b's seq dimension, for messages.
inline std::string block_rows(const RowBlock& b) {
  if (b.elements == 0) return "";
  return std::to_string(b.start[b.seq_dim]) + ".." + std::to_string(b.start[b.seq_dim] + b.count[b.seq_dim] - 1);
}

/// Point-to-point transfers of any size (messages of at most 1 GiB: MPI counts are int).
inline void send_bytes(const void* p, std::size_t bytes, int to, int tag, MPI_Comm comm) {
  const std::size_t chunk = std::size_t(1) << 30;
  for (std::size_t off = 0; off < bytes; off += chunk)
    MPI_Send(static_cast<const char*>(p) + off, static_cast<int>(std::min(chunk, bytes - off)), MPI_BYTE, to, tag,
             comm);
}
inline void recv_bytes(void* p, std::size_t bytes, int from, int tag, MPI_Comm comm) {
  const std::size_t chunk = std::size_t(1) << 30;
  for (std::size_t off = 0; off < bytes; off += chunk)
    MPI_Recv(static_cast<char*>(p) + off, static_cast<int>(std::min(chunk, bytes - off)), MPI_BYTE, from, tag, comm,
             MPI_STATUS_IGNORE);
}
/// A block's header for the rank-0 path: ndims starts, ndims counts, offset, elements.
inline std::vector<long> block_header(const RowBlock& b, std::size_t ndims) {
  std::vector<long> h(2 * ndims + 2, 0);
  for (std::size_t i = 0; i < ndims && i < b.start.size(); ++i) h[i] = b.start[i], h[ndims + i] = b.count[i];
  h[2 * ndims] = static_cast<long>(b.offset), h[2 * ndims + 1] = static_cast<long>(b.elements);
  return h;
}
inline RowBlock block_of_header(const long* h, std::size_t ndims, int seq_dim) {
  RowBlock b;
  b.seq_dim = seq_dim;
  b.start.assign(h, h + ndims), b.count.assign(h + ndims, h + 2 * ndims);
  b.offset = static_cast<std::size_t>(h[2 * ndims]), b.elements = static_cast<std::size_t>(h[2 * ndims + 1]);
  return b;
}

/// The innermost messages of HDF5's error stack (the driver's errno text or MPI error string first); call
/// right after the failing HDF5 call.
inline std::string hdf5_error_text() {
  std::vector<std::string> descs;
  H5Ewalk2(
      H5E_DEFAULT, H5E_WALK_UPWARD,
      [](unsigned, const H5E_error2_t* e, void* d) -> herr_t {
        auto* v = static_cast<std::vector<std::string>*>(d);
        if (!e->desc || !*e->desc || v->size() >= 3) return 0;
        std::string x = e->desc;
        // The POSIX driver's "file write failed: time = ..., errno = 28, error message = '...', ..."
        const auto m = x.find("error message = '");
        if (m != std::string::npos) {
          const auto b = m + 17, q = x.find('\'', b);
          x = x.substr(0, x.find(':')) + ": " + x.substr(b, q == std::string::npos ? std::string::npos : q - b);
        }
        v->push_back(x);
        return 0;
      },
      &descs);
  std::string out;
  for (const auto& x : descs) out += (out.empty() ? "" : "; ") + x;
  return out.empty() ? "no reason given by HDF5" : out;
}
}  // namespace detail

/// Every rank throws, as kfa::Error, the message of the first rank whose `local_error` is not empty (its
/// first 1023 characters); when all are empty every rank returns. Use it to turn a decision one rank makes
/// (a failed check, a file that cannot be written) into one every rank takes alike, so that none is left
/// waiting in a later collective call. Collective over comm. (kfa::dist::agree, shared with the ring.)
using kfa::dist::agree;

/// An HDF5 file opened for reading by every rank (parallel) or by rank 0 (serial). Every failure, also of a
/// metadata operation only rank 0 performs, is a collective decision: every rank throws the same kfa::Error
/// and none is left waiting in a collective call. Collective.
class Reader {
 public:
  Reader(const std::string& path, MPI_Comm comm) : m_comm(comm), m_path(path) {
    MPI_Comm_rank(comm, &m_rank);
    MPI_Comm_size(comm, &m_size);
    H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);  // our messages, not HDF5's error stacks
    std::string err;
    if (parallel_hdf5() || m_rank == 0) {
      struct stat st;
      if (::stat(path.c_str(), &st) != 0)
        err = "kfa::io: --input " + path + ": " + std::strerror(errno);
      else if (H5Fis_hdf5(path.c_str()) <= 0)
        err = "kfa::io: --input " + path + ": not an HDF5 file or truncated (" + std::to_string(st.st_size) +
              " bytes; no HDF5 signature found)";
      else
        err = mpi_io_path_problem("--input", path, m_size);  // H5Fopen hands the path to MPI-IO
    }
    kfa::dist::agree(comm, err);  // every rank knows before the collective H5Fopen
    if (parallel_hdf5() || m_rank == 0) {
      detail::Handle fapl = detail::file_access(comm);
      m_file = detail::Handle(H5Fopen(path.c_str(), H5F_ACC_RDONLY, fapl), H5Fclose);
      if (m_file.id < 0)
        err = "kfa::io: --input " + path + ": cannot be opened: not an HDF5 file or truncated (" +
              detail::hdf5_error_text() + ")";
    }
    kfa::dist::agree(comm, err);
  }
  /// Shape and type of dataset `name`; `exists` false when there is no such name. A name that is not a
  /// dataset (a group, say) or a link that cannot be followed (a dangling soft or external link) throws,
  /// naming the dataset and the link's target. With a parallel HDF5 every rank opens the dataset (opening
  /// is collective there: following an external link opens its file with the same MPI-IO access list);
  /// with a serial one rank 0 does. Every rank learns the outcome. Collective.
  DatasetInfo info(const std::string& name) {
    DatasetInfo d;
    std::string err;
    if (parallel_hdf5() || m_rank == 0) err = look(name, d);
    kfa::dist::agree(m_comm, err);
    // rank 0's answer for every rank (the same in parallel mode; the only one in serial mode)
    long buf[4 + 32] = {0};  // exists, type, rank, text length, dims
    std::string text = d.type_text;
    if (m_rank == 0) {
      buf[0] = d.exists, buf[1] = static_cast<long>(d.type), buf[2] = static_cast<long>(d.dims.size());
      buf[3] = static_cast<long>(text.size());
      for (size_t i = 0; i < d.dims.size() && i < 32; ++i) buf[4 + i] = d.dims[i];
    }
    MPI_Bcast(buf, 36, MPI_LONG, 0, m_comm);
    text.resize(static_cast<size_t>(buf[3]));
    if (buf[3] > 0) MPI_Bcast(&text[0], static_cast<int>(buf[3]), MPI_CHAR, 0, m_comm);
    d = DatasetInfo();
    d.exists = buf[0] == 1;
    d.type = static_cast<FileType>(buf[1]);
    d.type_text = text;
    for (long i = 0; i < buf[2] && i < 32; ++i) d.dims.push_back(buf[4 + i]);
    return d;
  }
  /// The whole of the rank-1 integer dataset `name` (an index such as cu_seqlens: int32 or int64 in the file), as
  /// int64 on every rank (read by every rank with a parallel HDF5, by rank 0 and broadcast with a serial one).
  /// A dataset of another rank or a floating-point type throws, naming it. Collective.
  std::vector<long> read_integers(const std::string& name, const DatasetInfo& info) {
    const std::string where = "kfa::io: --input " + m_path + ": dataset '" + name + "' ";
    if (info.dims.size() != 1)
      kfa::detail::fail(where, "has rank ", info.dims.size(), "; expected a rank-1 integer dataset");
    if (info.dims[0] > INT_MAX) kfa::detail::fail(where, "has ", info.dims[0], " entries, more than an index takes");
    std::vector<long long> v(static_cast<size_t>(info.dims[0]), 0);
    std::string err;
    if (parallel_hdf5() || m_rank == 0) {
      detail::Handle ds(H5Dopen2(m_file, name.c_str(), H5P_DEFAULT), H5Dclose);
      detail::Handle type(ds.id < 0 ? -1 : H5Dget_type(ds), H5Tclose);
      if (ds.id < 0 || type.id < 0)
        err = where + "cannot be opened (" + detail::hdf5_error_text() + ")";
      else if (H5Tget_class(type) != H5T_INTEGER)
        err = where + "has type " + info.type_text + "; expected an integer type (int32 or int64)";
      else if (!v.empty() && H5Dread(ds, H5T_NATIVE_LLONG, H5S_ALL, H5S_ALL, H5P_DEFAULT, v.data()) < 0)
        err = where + "cannot be read (" + detail::hdf5_error_text() + ")";
    }
    kfa::dist::agree(m_comm, err);
    if (!v.empty()) MPI_Bcast(v.data(), static_cast<int>(v.size()), MPI_LONG_LONG, 0, m_comm);
    return std::vector<long>(v.begin(), v.end());
  }
  /// Reads the rows `mine` (along dimension 1 of a [B, S, H, D] dataset; any number of segments, in any
  /// order, as their local_begin lays them out) into `out` [B, n_local, H, D] (host, row-major), converting from the
  /// file's float type to float or double. A read that fails on any rank (a corrupted compressed chunk in its rows,
  /// say) throws the same kfa::Error on every rank. Collective.
  template <class T>
  void read_rows(const std::string& name, const DatasetInfo& info, const std::vector<kfa::dist::Segment>& mine,
                 std::vector<T>& out) {
    static_assert(std::is_same<T, float>::value || std::is_same<T, double>::value, "read as float or double");
    std::vector<kfa::dist::Segment> places;
    const std::vector<kfa::dist::Segment> segs = detail::in_file_order(mine, &places);  // read so, then moved
    read_rows_in_file_order(name, info, segs, out);
    if (!detail::same_places(places, mine)) out = detail::moved_rows(out, info.dims, 1, places, mine);
  }
  /// Reads block `b` of dataset `name` (row_blocks of info.dims) into `out` (b.elements values), converting
  /// from the file's float type to M (float or double; HDF5 rounds to nearest, values beyond M's range
  /// become ±Inf). Every rank calls it alike, as often as the rank with the most blocks (a rank with fewer
  /// passes an empty block). A read that fails on any rank throws the same kfa::Error on every rank.
  /// Collective.
  template <class M>
  void read_block(const std::string& name, const DatasetInfo& info, const RowBlock& b, M* out) {
    static_assert(std::is_same<M, float>::value || std::is_same<M, double>::value, "read as float or double");
    const detail::Handle mem_type = detail::memory_type<M>();
    std::string err;
#ifdef KFA_IO_PARALLEL
    (void)info;
    detail::Handle ds(H5Dopen2(m_file, name.c_str(), H5P_DEFAULT), H5Dclose);
    if (ds.id < 0) err = read_failure(name, "opening", detail::block_rows(b));
    kfa::dist::agree(m_comm, err);
    detail::Handle fspace(H5Dget_space(ds), H5Sclose);
    detail::select_block(fspace, b);
    detail::Handle mspace = detail::block_memory_space(b);
    detail::Handle dxpl = detail::transfer();
    if (H5Dread(ds, mem_type, mspace, fspace, dxpl, out) < 0)
      err = read_failure(name, "reading", detail::block_rows(b));
    kfa::dist::agree(m_comm, err);
#else
    // Rank 0 reads every rank's block and sends it (zeros after a failure, so no rank is left waiting).
    const int tag = 79;
    const std::size_t nd = info.dims.size();
    const std::vector<long> mine = detail::block_header(b, nd);
    std::vector<long> all(m_rank == 0 ? mine.size() * static_cast<std::size_t>(m_size) : 0);
    MPI_Gather(mine.data(), static_cast<int>(mine.size()), MPI_LONG, all.data(), static_cast<int>(mine.size()),
               MPI_LONG, 0, m_comm);
    if (m_rank == 0) {
      detail::Handle ds(H5Dopen2(m_file, name.c_str(), H5P_DEFAULT), H5Dclose);
      if (ds.id < 0) err = read_failure(name, "opening", detail::block_rows(b));
      std::vector<M> buf;
      for (int r = m_size - 1; r >= 0; --r) {
        const RowBlock rb = detail::block_of_header(&all[mine.size() * static_cast<std::size_t>(r)], nd, b.seq_dim);
        if (rb.elements == 0) continue;
        M* dst = out;
        if (r != 0) buf.assign(rb.elements, M(0)), dst = buf.data();
        if (err.empty()) {
          detail::Handle fspace(H5Dget_space(ds), H5Sclose);
          detail::select_block(fspace, rb);
          detail::Handle mspace = detail::block_memory_space(rb);
          if (H5Dread(ds, mem_type, mspace, fspace, H5P_DEFAULT, dst) < 0)
            err = read_failure(name, "reading", detail::block_rows(rb));
        }
        if (r != 0) detail::send_bytes(buf.data(), buf.size() * sizeof(M), r, tag, m_comm);
      }
    } else if (b.elements > 0) {
      detail::recv_bytes(out, b.elements * sizeof(M), 0, tag, m_comm);
    }
    kfa::dist::agree(m_comm, err);
#endif
  }

 private:
  // What `name` is (this rank's view): "" with `d` filled in (d.exists false when there is no such name), or
  // why it cannot be used.
  std::string look(const std::string& name, DatasetInfo& d) const {
    const std::string where = "kfa::io: --input " + m_path + ": ";
    const htri_t ex = H5Lexists(m_file, name.c_str(), H5P_DEFAULT);
    if (ex < 0) return where + "cannot look up '" + name + "' (" + detail::hdf5_error_text() + ")";
    if (ex == 0) return "";
    const std::string link = detail::link_text(m_file, name);
    detail::Handle obj(H5Oopen(m_file, name.c_str(), H5P_DEFAULT), H5Oclose);
    if (obj.id < 0)
      return where + "dataset '" + name + "'" + link +
             (link.empty() ? " cannot be opened (" : " cannot be opened: its target is missing or unreadable (") +
             detail::hdf5_error_text() + ")";
    const H5I_type_t kind = H5Iget_type(obj);
    if (kind != H5I_DATASET)
      return where + "'" + name + "'" + link + " is " +
             (kind == H5I_GROUP      ? "a group"
              : kind == H5I_DATATYPE ? "a named datatype"
                                     : "not a dataset") +
             ", not a dataset";
    detail::Handle type(H5Dget_type(obj), H5Tclose);
    detail::Handle space(H5Dget_space(obj), H5Sclose);
    const int nd = space.id < 0 ? -1 : H5Sget_simple_extent_ndims(space);
    if (type.id < 0 || nd < 0)
      return where + "dataset '" + name + "'" + link + ": cannot read its type or shape (" + detail::hdf5_error_text() +
             ")";
    if (nd > 32) return where + "dataset '" + name + "' has rank " + std::to_string(nd) + "; expected 4";
    std::vector<hsize_t> dims(static_cast<size_t>(nd));
    if (nd > 0) H5Sget_simple_extent_dims(space, dims.data(), nullptr);
    d.exists = true;
    d.type = detail::classify(type);
    d.type_text = detail::type_text(type);
    for (hsize_t x : dims) {
      if (x > static_cast<hsize_t>(LONG_MAX))
        return where + "dataset '" + name + "' declares an extent of " + std::to_string(x) + ", beyond 64-bit sizes";
      d.dims.push_back(static_cast<long>(x));
    }
    return "";
  }
  // A failed open or read of `name` for the rows `segs`, with HDF5's innermost reason (a filter that failed:
  // a corrupted compressed chunk, say). Call right after the failing HDF5 call.
  std::string read_failure(const std::string& name, const char* what,
                           const std::vector<kfa::dist::Segment>& segs) const {
    std::string rows;
    for (const auto& s : segs)
      if (s.length > 0)
        rows += (rows.empty() ? "" : ", ") + std::to_string(s.global_begin) + ".." +
                std::to_string(s.global_begin + s.length - 1);
    return read_failure(name, what, rows);
  }
  std::string read_failure(const std::string& name, const char* what, const std::string& rows) const {
    return "kfa::io: --input " + m_path + ": " + what + " dataset '" + name + "' failed" +
           (rows.empty() ? "" : " (sequence rows " + rows + ")") + ": " + detail::hdf5_error_text();
  }
  // read_rows with `segs` in file order.
  template <class T>
  void read_rows_in_file_order(const std::string& name, const DatasetInfo& info,
                               const std::vector<kfa::dist::Segment>& segs, std::vector<T>& out) {
    const hid_t mem_type = std::is_same<T, double>::value ? H5T_NATIVE_DOUBLE : H5T_NATIVE_FLOAT;
    long n = 0;
    for (const auto& s : segs) n += s.length;
    const long row = info.dims[2] * info.dims[3];
    out.assign(static_cast<size_t>(info.dims[0] * n * row), T(0));
    std::string err;
#ifdef KFA_IO_PARALLEL
    detail::Handle ds(H5Dopen2(m_file, name.c_str(), H5P_DEFAULT), H5Dclose);
    if (ds.id < 0) err = read_failure(name, "opening", segs);
    kfa::dist::agree(m_comm, err);
    detail::Handle fspace(H5Dget_space(ds), H5Sclose);
    detail::select_rows(fspace, info.dims, 1, segs);
    const hsize_t mdims[4] = {static_cast<hsize_t>(info.dims[0]), static_cast<hsize_t>(n),
                              static_cast<hsize_t>(info.dims[2]), static_cast<hsize_t>(info.dims[3])};
    detail::Handle mspace(H5Screate_simple(4, mdims, nullptr), H5Sclose);
    if (n == 0) H5Sselect_none(mspace), H5Sselect_none(fspace);
    detail::Handle dxpl = detail::transfer();
    if (H5Dread(ds, mem_type, mspace, fspace, dxpl, out.data()) < 0) err = read_failure(name, "reading", segs);
    kfa::dist::agree(m_comm, err);
#else
    // Rank 0 reads every rank's rows and sends them (zeros after a failure, so no rank is left waiting);
    // the others receive theirs; then all agree.
    const int tag = 77;
    gather_segments(segs);  // collective: rank 0 learns every rank's rows
    if (m_rank == 0) {
      detail::Handle ds(H5Dopen2(m_file, name.c_str(), H5P_DEFAULT), H5Dclose);
      if (ds.id < 0) err = read_failure(name, "opening", segs);
      for (int r = m_size - 1; r >= 0; --r) {
        std::vector<kfa::dist::Segment> rs(m_segs_of(r));
        long nr = 0;
        for (const auto& s : rs) nr += s.length;
        std::vector<T> buf(static_cast<size_t>(info.dims[0] * nr * row), T(0));
        if (err.empty() && nr > 0) {
          detail::Handle fspace(H5Dget_space(ds), H5Sclose);
          detail::select_rows(fspace, info.dims, 1, rs);
          const hsize_t mdims[4] = {static_cast<hsize_t>(info.dims[0]), static_cast<hsize_t>(nr),
                                    static_cast<hsize_t>(info.dims[2]), static_cast<hsize_t>(info.dims[3])};
          detail::Handle mspace(H5Screate_simple(4, mdims, nullptr), H5Sclose);
          if (H5Dread(ds, mem_type, mspace, fspace, H5P_DEFAULT, buf.data()) < 0)
            err = read_failure(name, "reading", rs);
        }
        if (r == 0)
          out.swap(buf);
        else
          detail::send_bytes(buf.data(), buf.size() * sizeof(T), r, tag, m_comm);
      }
    } else {
      detail::recv_bytes(out.data(), out.size() * sizeof(T), 0, tag, m_comm);
    }
    kfa::dist::agree(m_comm, err);
#endif
  }
  // Serial mode: every rank's segments, gathered so rank 0 can read for them. Collective.
  void gather_segments(const std::vector<kfa::dist::Segment>& mine) {
    std::vector<long> local;
    for (const auto& x : mine) local.push_back(x.global_begin), local.push_back(x.length);
    int count = static_cast<int>(local.size());
    std::vector<int> counts(m_size), displs(m_size, 0);
    MPI_Allgather(&count, 1, MPI_INT, counts.data(), 1, MPI_INT, m_comm);
    for (int r = 1; r < m_size; ++r) displs[r] = displs[r - 1] + counts[r - 1];
    m_all_segs.assign(static_cast<size_t>(displs.back() + counts.back()), 0);
    MPI_Allgatherv(local.data(), count, MPI_LONG, m_all_segs.data(), counts.data(), displs.data(), MPI_LONG, m_comm);
    m_segs_at.assign(displs.begin(), displs.end());
    m_segs_at.push_back(static_cast<int>(m_all_segs.size()));
  }
  std::vector<kfa::dist::Segment> m_segs_of(int r) const {
    std::vector<kfa::dist::Segment> out;
    long lb = 0;
    for (int i = m_segs_at[r]; i < m_segs_at[r + 1]; i += 2) {
      out.push_back({m_all_segs[i], m_all_segs[i + 1], lb});
      lb += m_all_segs[i + 1];
    }
    return out;
  }
  MPI_Comm m_comm;
  std::string m_path;
  int m_rank = 0, m_size = 1;
  detail::Handle m_file;
  std::vector<long> m_all_segs;
  std::vector<int> m_segs_at;  // where each rank's pairs start in m_all_segs (m_size + 1)
};

/// An output file written to `<path>.tmp-<id>` in the same directory and renamed to `path` by commit().
/// Every step is a collective decision: when a dataset or attribute cannot be created or written, or the
/// final flush/close fails (a full disk, a quota, an I/O error) on any rank, every rank throws the same
/// kfa::Error naming what failed, the temporary is removed and `path` is left byte-identical. Destroyed
/// without commit(), the temporary is removed too. Collective.
///
/// Space: the temporary owns its disk blocks before HDF5 writes into it. Rank 0 allocates them (fallocate,
/// the file's size unchanged) for the expected size plus 1 MiB before HDF5 opens the file, and, where that
/// falls short, up to the end of each dataset plus 256 KiB when it is created (before a byte of it is
/// written); so every data and metadata write lands in blocks the file already has and cannot fail with
/// ENOSPC, whatever other processes do to the disk meanwhile. The blocks beyond the final size are given
/// back at the close. (They did: a disk filled after the old separate reservation made one
/// aggregator of Open MPI's collective write return "No space left on device" while the others waited for
/// it, a hang at P >= 3.) Where the file system has no fallocate (EOPNOTSUPP) the free space is checked
/// instead, 1 MiB for HDF5's metadata is kept in `<tmp>.reserve` until the close, and datasets are written
/// with independent MPI-IO, so that a write that fails returns on its rank and is agreed like any failure.
class Writer {
 public:
  /// `expected_bytes` (the datasets' sizes; 0: unknown) is allocated in the temporary before anything is
  /// written, so a disk without room for the output is refused here, before HDF5 touches it.
  Writer(const std::string& path, MPI_Comm comm, unsigned long long expected_bytes = 0) : m_comm(comm), m_path(path) {
    MPI_Comm_rank(comm, &m_rank);
    MPI_Comm_size(comm, &m_size);
    H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
    long id = static_cast<long>(MPI_Wtime() * 1e6) % 100000000;
    MPI_Bcast(&id, 1, MPI_LONG, 0, comm);
    m_tmp = kfa::io::temporary_path(path, id);
    m_reserve = m_tmp + ".reserve";
    // The temporary's name is short (temporary_stem); its directory may still make the path too long.
    kfa::dist::agree(comm, mpi_io_path_problem("--output " + path + ": its temporary", m_tmp, m_size));
    std::string err;
    if (m_rank == 0) err = reserve(expected_bytes);
    int preallocated = m_preallocated ? 1 : 0;  // rank 0's: every rank transfers alike
    MPI_Bcast(&preallocated, 1, MPI_INT, 0, comm);
    m_preallocated = preallocated == 1;
    try {
      agree(err);
      if (parallel_hdf5() || m_rank == 0) {
        // The temporary exists (rank 0 made it, empty): MPI-IO opens it without truncating an empty file, so
        // its blocks stay allocated; the serial driver truncates it (O_TRUNC), grow_allocation() restores them.
        detail::Handle fapl = detail::file_access(comm);
        m_file = detail::Handle(H5Fcreate(m_tmp.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, fapl), H5Fclose);
        if (m_file.id < 0) err = failure("creating");
      }
      agree(err);
    } catch (...) {  // the destructor does not run for a constructor that throws: clean up here
      release_reserve();
      if (m_rank == 0) std::remove(m_tmp.c_str());
      throw;
    }
    try {
      if (m_rank == 0) err = grow_allocation(-1, true);
      agree(err);
    } catch (...) {
      discard();
      throw;
    }
  }
  ~Writer() {
    if (m_committed) return;
    if (m_agreed_failure || std::uncaught_exceptions() == m_exceptions_at_start) {
      discard();  // every rank is here: a failure all ranks agreed on, or scope left without commit()
    } else {
      // An exception only this rank may have: no collective call (the others may be elsewhere); the
      // process is about to end. Remove the temporary so no debris is left.
      release_reserve();
      if (m_rank == 0) std::remove(m_tmp.c_str());
    }
  }
  Writer(const Writer&) = delete;
  Writer& operator=(const Writer&) = delete;

  /// Writes the rows `mine` (along `seq_dim`; any number of segments, in any order) of dataset `name` with
  /// global `dims`, from `rows` laid out as their local_begin say. Stored as float64, float32 or int64 like T.
  /// Collective.
  template <class T>
  void write_rows(const std::string& name, const std::vector<long>& dims, int seq_dim,
                  const std::vector<kfa::dist::Segment>& mine, const std::vector<T>& rows) {
    std::vector<kfa::dist::Segment> places;
    const std::vector<kfa::dist::Segment> segs = detail::in_file_order(mine, &places);  // HDF5's order of the union
    const std::vector<T> moved =
        detail::same_places(places, mine) ? std::vector<T>() : detail::moved_rows(rows, dims, seq_dim, mine, places);
    const std::vector<T>& data = moved.empty() ? rows : moved;
    static_assert(
        std::is_same<T, double>::value || std::is_same<T, float>::value || std::is_same<T, std::int64_t>::value,
        "write_rows stores float64, float32 or int64");
    const hid_t type = std::is_same<T, double>::value  ? H5T_NATIVE_DOUBLE
                       : std::is_same<T, float>::value ? H5T_NATIVE_FLOAT
                                                       : H5T_NATIVE_INT64;
    std::vector<hsize_t> hd(dims.begin(), dims.end());
    std::string err;
#ifdef KFA_IO_PARALLEL
    detail::Handle fspace(H5Screate_simple(static_cast<int>(hd.size()), hd.data(), nullptr), H5Sclose);
    detail::Handle ds(
        H5Dcreate2(m_file, name.c_str(), type, fspace, H5P_DEFAULT, detail::early_allocation(), H5P_DEFAULT), H5Dclose);
    if (ds.id < 0) err = failure("creating dataset '" + name + "' in");
    agree(err);
    ensure_allocated(ds);
    detail::select_rows(fspace, dims, seq_dim, segs);
    std::vector<hsize_t> md(hd);
    long n = 0;
    for (const auto& s : segs) n += s.length;
    md[seq_dim] = static_cast<hsize_t>(n);
    detail::Handle mspace(H5Screate_simple(static_cast<int>(md.size()), md.data(), nullptr), H5Sclose);
    if (n == 0) H5Sselect_none(mspace), H5Sselect_none(fspace);
    detail::Handle dxpl = detail::transfer(m_preallocated);
    if (H5Dwrite(ds, type, mspace, fspace, dxpl, data.data()) < 0) err = failure("writing dataset '" + name + "' to");
    agree(err);
#else
    // Rank 0 receives every rank's rows (always, even after a failure, so no rank is left in a send)
    // and writes them; then all agree.
    const int tag = 78;
    if (m_rank == 0) {
      detail::Handle fspace0(H5Screate_simple(static_cast<int>(hd.size()), hd.data(), nullptr), H5Sclose);
      detail::Handle ds(
          H5Dcreate2(m_file, name.c_str(), type, fspace0, H5P_DEFAULT, detail::early_allocation(), H5P_DEFAULT),
          H5Dclose);
      if (ds.id < 0) err = failure("creating dataset '" + name + "' in");
      if (err.empty()) err = grow_allocation(ds);
      for (int r = 0; r < m_size; ++r) {
        std::vector<T> buf;
        std::vector<kfa::dist::Segment> rs;
        if (r == 0) {
          rs = segs;
          buf = data;
        } else {
          long count = 0;
          MPI_Recv(&count, 1, MPI_LONG, r, tag, m_comm, MPI_STATUS_IGNORE);
          std::vector<long> hdr(static_cast<size_t>(count));
          MPI_Recv(hdr.data(), static_cast<int>(count), MPI_LONG, r, tag, m_comm, MPI_STATUS_IGNORE);
          long lb = 0;
          for (long i = 0; i < count; i += 2)
            if (hdr[i + 1] > 0) rs.push_back({hdr[i], hdr[i + 1], lb}), lb += hdr[i + 1];
          long elements = lb;
          for (size_t i = 0; i < dims.size(); ++i)
            if (static_cast<int>(i) != seq_dim) elements *= dims[i];
          buf.resize(static_cast<size_t>(elements));
          detail::recv_bytes(buf.data(), buf.size() * sizeof(T), r, tag, m_comm);
        }
        if (!err.empty()) continue;
        detail::Handle fspace(H5Dget_space(ds), H5Sclose);
        detail::select_rows(fspace, dims, seq_dim, rs);
        std::vector<hsize_t> md(hd);
        long n = 0;
        for (const auto& s : rs) n += s.length;
        md[seq_dim] = static_cast<hsize_t>(n);
        detail::Handle mspace(H5Screate_simple(static_cast<int>(md.size()), md.data(), nullptr), H5Sclose);
        if (n > 0 && H5Dwrite(ds, type, mspace, fspace, H5P_DEFAULT, buf.data()) < 0)
          err = failure("writing dataset '" + name + "' to");
      }
    } else {
      std::vector<long> hdr;
      for (const auto& x : segs) hdr.push_back(x.global_begin), hdr.push_back(x.length);
      long count = static_cast<long>(hdr.size());
      MPI_Send(&count, 1, MPI_LONG, 0, tag, m_comm);
      MPI_Send(hdr.data(), static_cast<int>(count), MPI_LONG, 0, tag, m_comm);
      detail::send_bytes(data.data(), data.size() * sizeof(T), 0, tag, m_comm);
    }
    agree(err);
#endif
  }
  /// Creates dataset `name` with global `dims`, stored as `stored` (float64, float32 or float16 as numpy and
  /// h5py write them), to be filled by write_block. Collective.
  void create_dataset(const std::string& name, const std::vector<long>& dims, FileType stored) {
    std::string err;
    if (parallel_hdf5() || m_rank == 0) {
      std::vector<hsize_t> hd(dims.begin(), dims.end());
      detail::Handle type = detail::file_type(stored);
      detail::Handle fspace(H5Screate_simple(static_cast<int>(hd.size()), hd.data(), nullptr), H5Sclose);
      detail::Handle ds(
          H5Dcreate2(m_file, name.c_str(), type, fspace, H5P_DEFAULT, detail::early_allocation(), H5P_DEFAULT),
          H5Dclose);
      if (ds.id < 0)
        err = failure("creating dataset '" + name + "' in");
      else
        m_datasets[name] = std::move(ds);
    }
    m_dims[name] = dims;
    agree(err);
    const auto created = m_datasets.find(name);
    ensure_allocated(created == m_datasets.end() ? -1
                                                 : created->second.id);  // its blocks, before write_block writes them
  }
  /// Writes block `b` (row_blocks of the dataset's dims) of dataset `name` (create_dataset) from `data`
  /// (b.elements values of M: float, double or Float16; HDF5 converts float and double to the stored type,
  /// Float16 is stored as it is). Every rank calls it alike, as often as the rank with the most blocks (a
  /// rank with fewer passes an empty block). Collective.
  template <class M>
  void write_block(const std::string& name, const RowBlock& b, const M* data) {
    const detail::Handle mem_type = detail::memory_type<M>();
    std::string err;
    const auto dims = m_dims.find(name);
    if (dims == m_dims.end()) kfa::detail::fail("kfa::io::Writer::write_block: no dataset '", name, "' was created");
#ifdef KFA_IO_PARALLEL
    const hid_t ds = m_datasets[name];
    detail::Handle fspace(H5Dget_space(ds), H5Sclose);
    detail::select_block(fspace, b);
    detail::Handle mspace = detail::block_memory_space(b);
    detail::Handle dxpl = detail::transfer(m_preallocated);
    if (H5Dwrite(ds, mem_type, mspace, fspace, dxpl, data) < 0) err = failure("writing dataset '" + name + "' to");
    agree(err);
#else
    // Rank 0 receives every rank's block (always, even after a failure, so no rank is left in a send) and
    // writes it; then all agree.
    const int tag = 80;
    const std::size_t nd = dims->second.size();
    if (m_rank == 0) {
      std::vector<M> buf;
      for (int r = 0; r < m_size; ++r) {
        RowBlock rb = b;
        const M* src = data;
        if (r != 0) {
          std::vector<long> h(2 * nd + 2);
          MPI_Recv(h.data(), static_cast<int>(h.size()), MPI_LONG, r, tag, m_comm, MPI_STATUS_IGNORE);
          rb = detail::block_of_header(h.data(), nd, b.seq_dim);
          buf.resize(rb.elements);
          detail::recv_bytes(buf.data(), rb.elements * sizeof(M), r, tag, m_comm);
          src = buf.data();
        }
        if (!err.empty() || rb.elements == 0) continue;
        const hid_t ds = m_datasets[name];
        detail::Handle fspace(H5Dget_space(ds), H5Sclose);
        detail::select_block(fspace, rb);
        detail::Handle mspace = detail::block_memory_space(rb);
        if (H5Dwrite(ds, mem_type, mspace, fspace, H5P_DEFAULT, src) < 0)
          err = failure("writing dataset '" + name + "' to");
      }
    } else {
      const std::vector<long> h = detail::block_header(b, nd);
      MPI_Send(h.data(), static_cast<int>(h.size()), MPI_LONG, 0, tag, m_comm);
      detail::send_bytes(data, b.elements * sizeof(M), 0, tag, m_comm);
    }
    agree(err);
#endif
  }
  /// Attributes on the file's root group, typed (same value on every rank; collective): a string as a
  /// variable-length UTF-8 string (h5py reads str), a bool as HDF5's enum {FALSE, TRUE} over int8 (what
  /// h5py writes for numpy.bool_, and reads back as one), an integer as int64, a floating-point value as
  /// float64.
  void attribute(const std::string& key, const std::string& value) {
    detail::Handle type(H5Tcopy(H5T_C_S1), H5Tclose);
    H5Tset_size(type, H5T_VARIABLE);
    H5Tset_cset(type, H5T_CSET_UTF8);
    const char* p = value.c_str();
    write_attribute(key, type, &p);
  }
  void attribute(const std::string& key, const char* value) {
    attribute(key, std::string(value));
  }
  void attribute(const std::string& key, bool value) {
    detail::Handle type(H5Tenum_create(H5T_NATIVE_SCHAR), H5Tclose);
    signed char f = 0, t = 1;
    H5Tenum_insert(type, "FALSE", &f);
    H5Tenum_insert(type, "TRUE", &t);
    const signed char v = value ? 1 : 0;
    write_attribute(key, type, &v);
  }
  void attribute(const std::string& key, double value) {
    write_attribute(key, H5T_NATIVE_DOUBLE, &value);
  }
  template <class I,
            typename std::enable_if<std::is_integral<I>::value && !std::is_same<I, bool>::value, int>::type = 0>
  void attribute(const std::string& key, I value) {
    const long long v = static_cast<long long>(value);
    write_attribute(key, H5T_NATIVE_LLONG, &v);
  }
  /// Flushes and closes the temporary, checking both on every rank; on a failure anywhere every rank
  /// throws (the temporary is removed, `path` untouched). Collective; commit() calls it if needed.
  void close() {
    if (m_closed) return;
    ensure_allocated();  // the last dataset + 256 KiB: room for the metadata the flush writes (attributes)
    release_reserve();   // no fallocate: the headroom kept back for HDF5's metadata
    m_datasets.clear();  // open datasets would make H5Fclose fail (MPI-IO files close with H5F_CLOSE_SEMI)
    MPI_Barrier(m_comm);
    std::string err;
    if (m_file.id >= 0 && H5Fflush(m_file, H5F_SCOPE_GLOBAL) < 0) err = failure("flushing");
    agree(err);
    if (m_file.id >= 0) {
      // A failed H5Fclose leaves an id HDF5 must not be asked about again (HDF5 1.10 frees the file
      // behind it): never retried.
      if (H5Fclose(m_file.id) < 0) err = failure("closing");
      m_file.id = -1;
    }
    agree(err);
    // HDF5 cut or extended the file to its end of allocation; the blocks allocated beyond that (the 1 MiB,
    // an overestimate) are given back by truncating to the size it has (ext4, tmpfs; best effort).
    struct stat st;
    if (m_rank == 0 && m_preallocated && ::stat(m_tmp.c_str(), &st) == 0 &&
        ::truncate(m_tmp.c_str(), st.st_size) != 0) {
      // harmless: the file is complete, only larger on disk
    }
    m_closed = true;
  }
  /// Closes the temporary (checked, as close()) and, only when that succeeded on every rank, renames it
  /// to the final path. Collective.
  void commit() {
    close();
    std::string err;
    if (m_rank == 0) {
      err = commit_temporary(m_tmp, m_path);
      if (!err.empty()) err = "kfa::io: --output " + m_path + ": " + err;
    }
    m_committed = true;  // renamed, or (on failure) removed by commit_temporary
    agree(err);
  }
  const std::string& temporary_path() const {
    return m_tmp;
  }

 private:
  // What failed, with HDF5's innermost reason (the driver's errno text or MPI error string) and whether
  // the file system is full. Call right after the failing HDF5 call.
  std::string failure(const std::string& what) const {
    return "kfa::io: --output " + m_path + ": " + what + " " + m_tmp + " failed (" + detail::hdf5_error_text() + ")" +
           full_filesystem_hint(m_path);
  }
  // A scalar attribute of `type` from `value` (the memory layout of one element of `type`). Collective.
  void write_attribute(const std::string& key, hid_t type, const void* value) {
    std::string err;
    if (parallel_hdf5() || m_rank == 0) {
      detail::Handle space(H5Screate(H5S_SCALAR), H5Sclose);
      detail::Handle attr(H5Acreate2(m_file, key.c_str(), type, space, H5P_DEFAULT, H5P_DEFAULT), H5Aclose);
      if (attr.id < 0 || H5Awrite(attr, type, value) < 0) err = failure("writing attribute '" + key + "' to");
    }
    agree(err);
  }
  // Every rank throws the first failing rank's message; the destructor then discards (collectively).
  void agree(const std::string& err) {
    try {
      kfa::dist::agree(m_comm, err);
    } catch (...) {
      m_agreed_failure = true;
      throw;
    }
  }
  // Removes the temporary on every path. The temporary is truncated first so a full file system has room
  // again for the metadata HDF5 writes while closing, the same on every rank (a close that fails on one
  // rank leaves the others inside HDF5's collectives); a close that still fails is
  // not retried (see close()). Collective.
  void discard() noexcept {
    release_reserve();
    if (m_rank == 0 && ::truncate(m_tmp.c_str(), 0) != 0) {
      // best effort: the file is removed below either way
    }
    m_datasets.clear();
    MPI_Barrier(m_comm);
    if (m_file.id >= 0) H5Fclose(m_file.id);  // checked nowhere: the file is being thrown away
    m_file.id = -1;
    MPI_Barrier(m_comm);
    if (m_rank == 0) std::remove(m_tmp.c_str());
    m_file.id = -1;
    m_committed = true;
  }
  // Collective (every rank, alike): grow_allocation(ds) on rank 0, agreed.
  void ensure_allocated(hid_t ds = -1) {
    std::string err;
    if (m_rank == 0) err = grow_allocation(ds);
    agree(err);
  }
  // Rank 0, preallocated temporaries only: allocates the temporary's blocks up to the end of the datasets'
  // storage (`ds`: one just created, its storage allocated at creation) plus 256 KiB for the metadata HDF5
  // allocates after them (attributes: a few KiB), where the first allocation (expected + 1 MiB) falls
  // short. `all`: from 0, as after H5Fcreate; else only beyond what was allocated. "" or why not.
  // (H5Fget_eoa would give HDF5's end of allocation, but only with a SWMR driver: MPI-IO is not one.)
  std::string grow_allocation(hid_t ds = -1, bool all = false) {
    if (!m_preallocated || m_file.id < 0) return "";
    if (ds >= 0) {
      const haddr_t at = H5Dget_offset(ds);
      if (at == HADDR_UNDEF) return failure("locating a dataset's storage in");
      m_data_end =
          std::max<unsigned long long>(m_data_end, static_cast<unsigned long long>(at) + H5Dget_storage_size(ds));
    }
    const unsigned long long need = std::max<unsigned long long>(m_data_end + k_trailing_metadata, m_allocated);
    const int rc = allocate_blocks(all ? 0 : m_allocated, need);
    if (rc == 0) return "";
    return "kfa::io: --output " + m_path + ": allocating " + std::to_string(need) + " bytes for " + m_tmp +
           " failed: " + std::strerror(rc) + " (" + free_bytes() + " bytes free)";
  }
  // Rank 0: disk blocks for bytes [from, to) of the temporary, its size unchanged (the file stays as HDF5
  // writes it); 0 or the errno (EOPNOTSUPP: a file system without fallocate, or the KFA_IO_NO_FALLOCATE test
  // hook). glibc's posix_fallocate is not used: where the file system lacks fallocate it writes a byte per
  // block instead, slowly (one write per 4 KiB over NFS), and without its promise on copy-on-write ones.
  int allocate_blocks(unsigned long long from, unsigned long long to) {
    if (to <= from) return 0;
    if (const char* e = std::getenv("KFA_IO_NO_FALLOCATE"))
      if (*e && std::strcmp(e, "0") != 0) return EOPNOTSUPP;
    const int fd = ::open(m_tmp.c_str(), O_WRONLY | O_CLOEXEC);
    if (fd < 0) return errno;
    int rc;
    do {
      rc = ::fallocate(fd, FALLOC_FL_KEEP_SIZE, static_cast<off_t>(from), static_cast<off_t>(to - from)) == 0 ? 0
                                                                                                              : errno;
    } while (rc == EINTR);
    ::close(fd);
    if (rc == 0) m_allocated = std::max(m_allocated, to);
    return rc;
  }
  std::string free_bytes() const {
    struct statvfs fs;
    if (::statvfs(parent_directory(m_path).c_str(), &fs) != 0) return "?";
    return std::to_string(static_cast<unsigned long long>(fs.f_bavail) * fs.f_frsize);
  }
  // Rank 0: creates the temporary (empty) and allocates its blocks for `expected` bytes plus the headroom
  // (m_preallocated). Without fallocate: checks the free space and keeps the headroom, written, in
  // `<tmp>.reserve` until the close, so HDF5 can write its metadata then. "" or why not (no space: the sizes).
  std::string reserve(unsigned long long expected) {
    const int fd = ::open(m_tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
    if (fd < 0) return "kfa::io: --output " + m_path + ": cannot create " + m_tmp + ": " + std::strerror(errno);
    ::close(fd);
    const unsigned long long total = expected + k_headroom;
    int rc = allocate_blocks(0, total);
    m_preallocated = rc == 0;
    if (rc == EOPNOTSUPP || rc == ENOSYS) {
      struct statvfs fs;
      if (::statvfs(parent_directory(m_path).c_str(), &fs) == 0 &&
          static_cast<double>(fs.f_bavail) * fs.f_frsize < static_cast<double>(total)) {
        rc = ENOSPC;
      } else {
        const int rfd = ::open(m_reserve.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
        if (rfd < 0) {
          const std::string why = std::strerror(errno);
          ::unlink(m_tmp.c_str());
          return "kfa::io: --output " + m_path + ": cannot create " + m_reserve + ": " + why;
        }
        std::vector<char> zeros(static_cast<size_t>(k_headroom), 0);
        rc = ::write(rfd, zeros.data(), zeros.size()) == static_cast<ssize_t>(zeros.size()) ? 0 : (errno ? errno : EIO);
        if (rc == 0 && ::fsync(rfd) != 0 && errno != EINVAL) rc = errno;
        ::close(rfd);
      }
    }
    if (rc == 0) return "";
    release_reserve();
    ::unlink(m_tmp.c_str());
    return "kfa::io: --output " + m_path + ": cannot reserve " + std::to_string(total) + " bytes (" +
           std::to_string(expected) + " of data + 1 MiB for HDF5 metadata) in " + parent_directory(m_path) + ": " +
           std::strerror(rc) + " (" + free_bytes() + " bytes free); nothing was written";
  }
  void release_reserve() {
    if (m_rank == 0 && !m_reserve.empty()) ::unlink(m_reserve.c_str());
    m_reserve.clear();
  }
  MPI_Comm m_comm;
  std::string m_path, m_tmp, m_reserve;
  int m_rank = 0, m_size = 1;
  detail::Handle m_file;
  std::map<std::string, detail::Handle> m_datasets;  // created by create_dataset, open until close()
  std::map<std::string, std::vector<long>> m_dims;
  bool m_closed = false, m_committed = false, m_agreed_failure = false;
  bool m_preallocated = false;         // the temporary's blocks are allocated (agreed); else independent writes
  unsigned long long m_allocated = 0;  // rank 0: bytes [0, m_allocated) of the temporary have blocks
  unsigned long long m_data_end = 0;   // rank 0: the end of the last dataset's storage in the file
  static constexpr unsigned long long k_headroom = 1 << 20;           // allocated beyond the expected bytes
  static constexpr unsigned long long k_trailing_metadata = 1 << 18;  // allocated beyond the last dataset
  int m_exceptions_at_start = std::uncaught_exceptions();
};

/// Closes every HDF5 object still open (one left by a close that failed on a full disk, say) while MPI is
/// still up: call before MPI_Finalize, whose HDF5 clean-up would otherwise close it without MPI.
inline void finalize() {
  H5close();
}

}  // namespace io
}  // namespace kfa
