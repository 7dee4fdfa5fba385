// read_file and write_file_atomically (see qkv/io/file.hpp).
#include "qkv/io/file.hpp"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#include "qkv/core/error.hpp"

namespace qkv::io {

namespace {
std::string limit_text(uint64_t bytes) {
  return bytes >= (uint64_t{1} << 20) ? std::to_string(bytes >> 20) + " MiB" : std::to_string(bytes) + " bytes";
}
}  // namespace

std::vector<std::byte> read_file(const std::string& path, uint64_t max_bytes) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw IoError(path + ": cannot open: " + std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) == 0 && S_ISDIR(st.st_mode)) {
    ::close(fd);
    throw IoError(path + ": is a directory; give a file");
  }
  // A character or block device other than a terminal (/dev/zero, /dev/urandom, a disk) has no end to read to.
  if ((S_ISCHR(st.st_mode) && !::isatty(fd) && st.st_rdev != makedev(1, 3)) || S_ISBLK(st.st_mode)) {
    ::close(fd);
    throw IoError(path + ": is a device, not a file; give a file (or - for standard input)");
  }
  if (S_ISREG(st.st_mode) && static_cast<uint64_t>(st.st_size) > max_bytes) {
    ::close(fd);
    throw IoError(path + ": is " + limit_text(static_cast<uint64_t>(st.st_size)) + ", more than the " +
                  limit_text(max_bytes) + " qkv reads here; split it into smaller files");
  }
  // Read until the end rather than trusting the size: pipes, FIFOs and <(…) have none.
  std::vector<std::byte> bytes;
  if (S_ISREG(st.st_mode) && st.st_size > 0) bytes.reserve(static_cast<size_t>(st.st_size));
  std::byte buffer[1 << 16];
  while (true) {
    const ssize_t n = ::read(fd, buffer, sizeof buffer);
    if (n == 0) break;
    if (n < 0) {
      if (errno == EINTR) continue;
      const std::string why = std::strerror(errno);
      ::close(fd);
      throw IoError(path + ": read failed: " + why);
    }
    if (bytes.size() + static_cast<uint64_t>(n) > max_bytes) {
      ::close(fd);
      throw IoError(path + ": more than the " + limit_text(max_bytes) + " qkv reads here; split it into smaller files");
    }
    bytes.insert(bytes.end(), buffer, buffer + n);
  }
  ::close(fd);
  return bytes;
}

namespace {

// Writes all bytes to fd; false with errno set on failure.
bool write_all(int fd, std::span<const std::byte> bytes) {
  size_t written = 0;
  while (written < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + written, bytes.size() - written);
    if (n < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    written += static_cast<size_t>(n);
  }
  return true;
}

}  // namespace

void write_file_atomically(const std::string& path_given, std::span<const std::byte> bytes) {
  namespace fs = std::filesystem;
  std::error_code ec;
  // A symbolic link: write its target (replacing the link with a file would surprise whoever made it).
  std::string path = path_given;
  if (fs::is_symlink(path_given, ec)) path = fs::weakly_canonical(path_given, ec).string();
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode)) {
    // A device, pipe or socket (/dev/null, /dev/stdout, a FIFO): write into it; renaming over it would replace
    // the device with a regular file.
    if (S_ISDIR(st.st_mode)) throw IoError(path_given + ": is a directory; give a file name");
    const int fd = ::open(path.c_str(), O_WRONLY | O_CLOEXEC);
    if (fd < 0) throw IoError(path_given + ": cannot open for writing: " + std::strerror(errno));
    const bool ok = write_all(fd, bytes);
    const std::string why = std::strerror(errno);
    ::close(fd);
    if (!ok) throw IoError(path_given + ": write failed: " + why);
    return;
  }
  const std::string temp = path + ".tmp." + std::to_string(getpid());
  const int fd = ::open(temp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw IoError(path_given + ": cannot create " + temp + ": " + std::strerror(errno));
  if (!write_all(fd, bytes)) {
    const std::string why = std::strerror(errno);
    ::close(fd);
    ::unlink(temp.c_str());
    throw IoError(path_given + ": write failed: " + why);
  }
  if (::fsync(fd) != 0 || ::close(fd) != 0) {
    const std::string why = std::strerror(errno);
    ::unlink(temp.c_str());
    throw IoError(path_given + ": cannot flush to disk: " + why);
  }
  if (std::rename(temp.c_str(), path.c_str()) != 0) {
    const std::string why = std::strerror(errno);
    ::unlink(temp.c_str());
    throw IoError(path_given + ": cannot move the new file into place: " + why);
  }
}

int remove_stale_temporaries(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::path target(path);
  const fs::path dir = target.has_parent_path() ? target.parent_path() : fs::path(".");
  const std::string prefix = target.filename().string() + ".tmp.";
  int removed = 0;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind(prefix, 0) != 0) continue;
    const std::string pid_text = name.substr(prefix.size());
    if (pid_text.empty() || pid_text.find_first_not_of("0123456789") != std::string::npos) continue;
    const long pid = std::strtol(pid_text.c_str(), nullptr, 10);
    // A live process may be writing it right now (kill(pid, 0) answers without signalling).
    if (pid == getpid() || (pid > 0 && ::kill(static_cast<pid_t>(pid), 0) == 0)) continue;
    if (fs::remove(entry.path(), ec)) ++removed;
  }
  return removed;
}

}  // namespace qkv::io
