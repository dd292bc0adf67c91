#pragma once
/// kfa::io files — POSIX helpers for output safety, without HDF5 or MPI: do two paths name the same file
/// (device + inode after links, or directory + name when a path does not exist yet), is an output's
/// directory there and writable, which temporaries of an earlier killed run lie beside an output, what a
/// full file system looks like in a message, and a text file written to a temporary and renamed.
#include <dirent.h>
#include <fcntl.h>
#include <limits.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace kfa {
namespace io {

/// The directory part of `path` ("." for a bare name, "/" for "/x").
inline std::string parent_directory(const std::string& path) {
  const auto slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}
/// The name part of `path` (after the last '/').
inline std::string base_name(const std::string& path) {
  const auto slash = path.find_last_of('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}

/// What a path resolves to: an existing file (device + inode, links followed), or, for a path that does not
/// exist yet, the resolved directory and the name that would be created there.
struct FileIdentity {
  bool exists = false;
  dev_t dev = 0;
  ino_t ino = 0;
  std::string directory, name;  // when !exists: realpath of the parent directory (empty if it is missing)
};

inline FileIdentity identify(const std::string& path) {
  FileIdentity id;
  struct stat st;
  if (::stat(path.c_str(), &st) == 0) {
    id.exists = true, id.dev = st.st_dev, id.ino = st.st_ino;
    return id;
  }
  char buf[PATH_MAX];
  if (::realpath(parent_directory(path).c_str(), buf)) id.directory = buf;
  id.name = base_name(path);
  return id;
}

/// True when writing `a` would write the file `b` names (or the other way round).
inline bool same_file(const FileIdentity& a, const FileIdentity& b) {
  if (a.exists && b.exists) return a.dev == b.dev && a.ino == b.ino;
  if (a.exists || b.exists) return false;
  return !a.directory.empty() && a.directory == b.directory && a.name == b.name;
}

/// "" when `path` can be created or replaced by a temporary + rename; else why not, in the user's terms.
/// `option` names the option in the message ("--output").
inline std::string output_path_problem(const std::string& option, const std::string& path) {
  if (path.empty()) return option + " needs a file name (got an empty string)";
  if (path.back() == '/') return option + " " + path + ": names a directory, not a file";
  const std::string dir = parent_directory(path);
  struct stat st;
  if (::stat(dir.c_str(), &st) != 0)
    return option + " " + path + ": directory " + dir + " does not exist (" + std::strerror(errno) + ")";
  if (!S_ISDIR(st.st_mode)) return option + " " + path + ": " + dir + " is not a directory";
  if (::access(dir.c_str(), W_OK | X_OK) != 0)
    return option + " " + path + ": directory " + dir + " is not writable (" + std::strerror(errno) + ")";
  if (::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) return option + " " + path + ": is a directory";
  // A name the file system cannot hold would fail only at the final rename, after all the work.
  const long name_max = ::pathconf(dir.c_str(), _PC_NAME_MAX);
  const std::string base = base_name(path);
  if (name_max > 0 && static_cast<long>(base.size()) > name_max)
    return option + " " + path + ": the file name has " + std::to_string(base.size()) +
           " characters; the file system holding " + dir + " allows at most " + std::to_string(name_max) +
           " (NAME_MAX)";
  return "";
}

/// The name part of `path`'s temporaries, before ".tmp-<id>": the name itself when it has at most 96
/// characters, else its first 80 and a hash of all of it ("<80 chars>~1a2b3c4d"). Short because the
/// temporary is what MPI-IO opens: Open MPI 4.1's shared file-pointer components build file names of their
/// own from it (`<path>.locktest.<rank>` in a 256-byte buffer, which overflows and aborts the job;
/// `<name>_cid-<c>-<pid>.sm`), and `<name>.tmp-<id>.reserve` must stay within NAME_MAX (255) for any
/// legal output name. The output is renamed to the user's name at the end.
inline std::string temporary_stem(const std::string& path) {
  const std::string base = base_name(path);
  if (base.size() <= 96) return base;
  unsigned long long h = 1469598103934665603ULL;  // FNV-1a: distinct long names keep distinct temporaries
  for (unsigned char ch : base) h = (h ^ ch) * 1099511628211ULL;
  char hex[24];
  std::snprintf(hex, sizeof hex, "~%08llx", h & 0xffffffffULL);
  return base.substr(0, 80) + hex;
}

/// Names of files `<stem>.tmp-*` beside `path` (temporary_stem): temporaries of an earlier run that was
/// killed before it could remove them (or of a run writing the same output right now).
inline std::vector<std::string> stale_temporaries(const std::string& path) {
  std::vector<std::string> out;
  const std::string dir = parent_directory(path), prefix = temporary_stem(path) + ".tmp-";
  if (DIR* d = ::opendir(dir.c_str())) {
    while (const dirent* e = ::readdir(d)) {
      const std::string n = e->d_name;
      if (n.compare(0, prefix.size(), prefix) == 0) out.push_back(dir == "." ? n : dir + "/" + n);
    }
    ::closedir(d);
  }
  return out;
}

/// ", the file system holding DIR is full (N bytes free)" when it nearly is, else "".
inline std::string full_filesystem_hint(const std::string& path) {
  struct statvfs fs;
  const std::string dir = parent_directory(path);
  if (::statvfs(dir.c_str(), &fs) != 0) return "";
  const double avail = static_cast<double>(fs.f_bavail) * static_cast<double>(fs.f_frsize);
  if (avail >= 1048576.0) return "";
  char b[64];
  std::snprintf(b, sizeof b, "%.0f", avail);
  return "; the file system holding " + dir + " is full (no space left on device: " + b + " bytes free)";
}

/// The temporary of `path` for one run, `<dir>/<stem>.tmp-<id>` in `path`'s directory (temporary_stem: the
/// name itself unless it is long); the caller broadcasts `id` so every rank agrees.
inline std::string temporary_path(const std::string& path, long id) {
  const auto slash = path.find_last_of('/');
  const std::string dir = slash == std::string::npos ? std::string() : path.substr(0, slash + 1);
  return dir + temporary_stem(path) + ".tmp-" + std::to_string(id);
}

/// Writes `text` to `tmp` (created exclusively) and flushes it to disk; "" or what failed (errno text).
/// The caller renames `tmp` over the final path with commit_temporary() or removes it.
inline std::string write_text_temporary(const std::string& tmp, const std::string& text) {
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
  if (fd < 0) return "cannot create " + tmp + ": " + std::strerror(errno);
  std::string err;
  size_t done = 0;
  while (done < text.size() && err.empty()) {
    const ssize_t w = ::write(fd, text.data() + done, text.size() - done);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0)
      err = "writing " + tmp + " failed: " + std::strerror(w < 0 ? errno : EIO);
    else
      done += static_cast<size_t>(w);
  }
  if (err.empty() && ::fsync(fd) != 0 && errno != EINVAL) err = "flushing " + tmp + " failed: " + std::strerror(errno);
  if (::close(fd) != 0 && err.empty()) err = "closing " + tmp + " failed: " + std::strerror(errno);
  if (!err.empty()) ::unlink(tmp.c_str());
  return err;
}

/// Renames `tmp` to `path` (atomic within a directory); "" or what failed. The temporary is removed on failure.
inline std::string commit_temporary(const std::string& tmp, const std::string& path) {
  if (std::rename(tmp.c_str(), path.c_str()) == 0) return "";
  const std::string err = "renaming " + tmp + " to " + path + " failed: " + std::strerror(errno);
  ::unlink(tmp.c_str());
  return err;
}

}  // namespace io
}  // namespace kfa
