// read_file, write_file_atomically, AtomicFileWriter and MappedFile (see qkv/io/file.hpp).
#include "qkv/io/file.hpp"
#include "qkv/kernels/memory.hpp"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
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

void write_file_atomically(const std::string& path, std::span<const std::byte> bytes) {
  AtomicFileWriter writer(path);
  writer.write(bytes);
  writer.commit();
}

namespace {
constexpr size_t kWriteBuffer = size_t{1} << 20;  // large enough that write(2) calls cost nothing beside the disk
}  // namespace

AtomicFileWriter::AtomicFileWriter(const std::string& path_given) : path_given_(path_given), path_(path_given) {
  namespace fs = std::filesystem;
  std::error_code ec;
  // A symbolic link: write its target (replacing the link with a file would surprise whoever made it).
  if (fs::is_symlink(path_given, ec)) path_ = fs::weakly_canonical(path_given, ec).string();
  struct stat st {};
  if (::stat(path_.c_str(), &st) == 0 && !S_ISREG(st.st_mode)) {
    // A device, pipe or socket (/dev/null, /dev/stdout, a FIFO): write into it; renaming over it would replace
    // the device with a regular file.
    if (S_ISDIR(st.st_mode)) throw IoError(path_given + ": is a directory; give a file name");
    fd_ = ::open(path_.c_str(), O_WRONLY | O_CLOEXEC);
    if (fd_ < 0) throw IoError(path_given + ": cannot open for writing: " + std::strerror(errno));
  } else {
    temp_ = path_ + ".tmp." + std::to_string(getpid());
    fd_ = ::open(temp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd_ < 0) throw IoError(path_given + ": cannot create " + temp_ + ": " + std::strerror(errno));
  }
}

AtomicFileWriter::~AtomicFileWriter() { abandon(); }

void AtomicFileWriter::abandon() noexcept {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
  if (!temp_.empty()) ::unlink(temp_.c_str());
  temp_.clear();
}

void AtomicFileWriter::flush_buffer() {
  if (fd_ < 0) throw IoError(path_given_ + ": written after it was committed or abandoned");
  if (!write_all(fd_, buffer_)) {
    const std::string why = std::strerror(errno);
    abandon();
    throw IoError(path_given_ + ": write failed: " + why);
  }
  buffer_.clear();
}

void AtomicFileWriter::write(std::span<const std::byte> bytes) {
  if (fd_ < 0) throw IoError(path_given_ + ": written after it was committed or abandoned");
  written_ += bytes.size();
  if (buffer_.size() + bytes.size() <= kWriteBuffer) {
    buffer_.insert(buffer_.end(), bytes.begin(), bytes.end());
    return;
  }
  flush_buffer();
  if (bytes.size() >= kWriteBuffer) {  // a large piece goes straight to the file, without a copy
    if (!write_all(fd_, bytes)) {
      const std::string why = std::strerror(errno);
      abandon();
      throw IoError(path_given_ + ": write failed: " + why);
    }
  } else {
    buffer_.insert(buffer_.end(), bytes.begin(), bytes.end());
  }
}

void AtomicFileWriter::write_zeros(uint64_t count) {
  static const std::byte kZeros[4096] = {};
  while (count > 0) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(count, sizeof kZeros));
    write({kZeros, n});
    count -= n;
  }
}

void AtomicFileWriter::commit() {
  flush_buffer();
  if (temp_.empty()) {  // a device: nothing to rename
    ::close(fd_);
    fd_ = -1;
    return;
  }
  if (::fsync(fd_) != 0 || ::close(fd_) != 0) {
    const std::string why = std::strerror(errno);
    fd_ = -1;
    abandon();
    throw IoError(path_given_ + ": cannot flush to disk: " + why);
  }
  fd_ = -1;
  if (std::rename(temp_.c_str(), path_.c_str()) != 0) {
    const std::string why = std::strerror(errno);
    abandon();
    throw IoError(path_given_ + ": cannot move the new file into place: " + why);
  }
  temp_.clear();
}

namespace {
int advice_of(MapAccess access) {
  switch (access) {
    case MapAccess::Normal: return MADV_NORMAL;
    case MapAccess::Sequential: return MADV_SEQUENTIAL;
    case MapAccess::Random: return MADV_RANDOM;
    case MapAccess::WillNeed: return MADV_WILLNEED;
  }
  return MADV_NORMAL;
}
}  // namespace

MappedFile MappedFile::open(const std::string& path, MapAccess access) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw IoError(path + ": cannot open: " + std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const std::string why = std::strerror(errno);
    ::close(fd);
    throw IoError(path + ": cannot read its size: " + why);
  }
  if (S_ISDIR(st.st_mode)) {
    ::close(fd);
    throw IoError(path + ": is a directory; give a file");
  }
  // A pipe or device has no length to map (and /dev/zero would map forever): only regular files.
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    throw IoError(path + ": not a regular file (a pipe or device cannot be mapped); save it to a file first");
  }
  MappedFile file;
  file.path_ = path;
  file.fd_ = fd;
  file.size_ = static_cast<size_t>(st.st_size);
  if (file.size_ > 0) {
    void* address = ::mmap(nullptr, file.size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (address == MAP_FAILED) {
      const std::string why = std::strerror(errno);
      file.reset();
      throw IoError(path + ": cannot map the file: " + why);
    }
    file.data_ = static_cast<const std::byte*>(address);
    memory::register_file_mapping(address, file.size_);
    if (access != MapAccess::Normal) ::madvise(address, file.size_, advice_of(access));
  }
  return file;
}

MappedFile::MappedFile(MappedFile&& other) noexcept
    : path_(std::move(other.path_)), data_(other.data_), size_(other.size_), fd_(other.fd_) {
  other.data_ = nullptr;
  other.size_ = 0;
  other.fd_ = -1;
}

MappedFile& MappedFile::operator=(MappedFile&& other) noexcept {
  if (this != &other) {
    reset();
    path_ = std::move(other.path_);
    data_ = other.data_;
    size_ = other.size_;
    fd_ = other.fd_;
    other.data_ = nullptr;
    other.size_ = 0;
    other.fd_ = -1;
  }
  return *this;
}

MappedFile::~MappedFile() { reset(); }

void MappedFile::reset() noexcept {
  if (data_) memory::unregister_file_mapping(data_), ::munmap(const_cast<std::byte*>(data_), size_);
  if (fd_ >= 0) ::close(fd_);
  data_ = nullptr;
  size_ = 0;
  fd_ = -1;
}

namespace {
// The whole pages inside [offset, offset + length) of a mapping of `size` bytes at `base`, as [first, last).
std::pair<uintptr_t, uintptr_t> whole_pages(const std::byte* base, size_t size, uint64_t offset, uint64_t length) {
  if (!base || offset >= size) return {0, 0};
  length = std::min<uint64_t>(length, size - offset);
  const uintptr_t page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const uintptr_t begin = reinterpret_cast<uintptr_t>(base) + offset;
  const uintptr_t first = (begin + page - 1) / page * page;
  const uintptr_t last = (begin + length) / page * page;
  return {first, std::max(first, last)};
}
}  // namespace

void MappedFile::advise(uint64_t offset, uint64_t length, MapAccess access) const {
  // Hints may start mid-page: the page holding `offset` is included (the mapping starts on a page boundary).
  if (!data_ || offset >= size_) return;
  length = std::min<uint64_t>(length, size_ - offset);
  const uintptr_t page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(data_) + offset) / page * page;
  const uintptr_t end = reinterpret_cast<uintptr_t>(data_) + offset + length;
  if (end > begin) ::madvise(reinterpret_cast<void*>(begin), end - begin, advice_of(access));
}

void MappedFile::release(uint64_t offset, uint64_t length) const {
  // Only whole pages: a page shared with a neighbouring tensor may still be in use.
  const auto [first, last] = whole_pages(data_, size_, offset, length);
  if (last > first) ::madvise(reinterpret_cast<void*>(first), last - first, MADV_DONTNEED);
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

namespace {
// The length of the UTF-8 sequence starting at text[i] (1-4), or 0 if it is not one; a sequence cut by the end of
// the buffer counts as whole (the sniff reads only the start of a file).
size_t utf8_sequence(std::span<const std::byte> text, size_t i) {
  const auto byte = [&](size_t k) { return static_cast<unsigned char>(text[k]); };
  const unsigned char c = byte(i);
  const size_t n = c < 0x80 ? 1 : (c >> 5) == 0x6 && c >= 0xC2 ? 2 : (c >> 4) == 0xE ? 3 : (c >> 3) == 0x1E && c <= 0xF4 ? 4 : 0;
  for (size_t k = 1; k < n && i + k < text.size(); ++k)
    if ((byte(i + k) & 0xC0) != 0x80) return 0;
  return n;
}

bool looks_like_text(std::span<const std::byte> head) {
  for (size_t i = 0; i < head.size();) {
    const unsigned char c = static_cast<unsigned char>(head[i]);
    if (c == 0 || (c < 0x20 && c != '\n' && c != '\r' && c != '\t' && c != '\f') || c == 0x7F) return false;
    const size_t n = utf8_sequence(head, i);
    if (n == 0) return false;
    i += n;
  }
  return true;
}

// The text's first words, quoted and made printable: ("In the beginning God created…").
std::string opening_words(std::span<const std::byte> head) {
  std::string line;
  for (std::byte b : head) {
    const char c = static_cast<char>(b);
    if (c == '\n' || c == '\r') {
      if (line.find_first_not_of(" \t") != std::string::npos) break;
      line.clear();
      continue;
    }
    line += c;
  }
  const size_t start = line.find_first_not_of(" \t");
  line = start == std::string::npos ? "" : line.substr(start);
  if (line.size() > 40) {  // cut at a character boundary
    size_t cut = 40;
    while (cut > 0 && (static_cast<unsigned char>(line[cut]) & 0xC0) == 0x80) --cut;
    line = line.substr(0, cut) + "...";  // ASCII: printable() escapes the rest
  }
  return "\"" + printable(line, 60) + "\"";
}
}  // namespace

FileFormat sniff_bytes(std::span<const std::byte> head, uint64_t total_size) {
  const auto byte = [&](size_t k) { return k < head.size() ? static_cast<unsigned char>(head[k]) : 0; };
  const auto starts = [&](std::string_view magic) {
    return head.size() >= magic.size() && std::memcmp(head.data(), magic.data(), magic.size()) == 0;
  };
  if (head.empty()) return {FileKind::Empty, "an empty file"};
  if (starts("GGUF") && head.size() >= 8) {
    const uint32_t version = byte(4) | byte(5) << 8 | byte(6) << 16 | static_cast<uint32_t>(byte(7)) << 24;
    return {FileKind::Gguf, "a GGUF file (version " + std::to_string(version) + ", llama.cpp's format)"};
  }
  if (head.size() >= 9 && byte(8) == '{') {
    uint64_t length = 0;
    for (int k = 7; k >= 0; --k) length = length << 8 | byte(static_cast<size_t>(k));
    if (length >= 2 && length <= total_size - 8) return {FileKind::Safetensors, "a safetensors file"};
  }
  if (starts("PK\x03\x04")) return {FileKind::Zip, "a zip archive (the format of PyTorch's .pth files)"};
  if (byte(0) == 0x80 && byte(1) >= 2 && byte(1) <= 5)
    return {FileKind::Pickle, "a Python pickle (protocol " + std::to_string(byte(1)) + ")"};
  if (starts("\x93NUMPY")) return {FileKind::Npy, "a NumPy .npy array"};
  if (byte(0) == 0x1F && byte(1) == 0x8B) return {FileKind::Gzip, "gzip-compressed data"};
  if (looks_like_text(head)) {
    size_t first = 0;
    while (first < head.size() && std::isspace(byte(first))) ++first;
    if (byte(first) == '{' || byte(first) == '[') return {FileKind::Json, "JSON text"};
    return {FileKind::Text, "UTF-8 text (" + opening_words(head) + ")"};
  }
  if (starts("\x89PNG")) return {FileKind::Binary, "a PNG image"};
  if (starts("\x7F" "ELF")) return {FileKind::Binary, "an executable (ELF)"};
  char first_bytes[40];
  std::snprintf(first_bytes, sizeof first_bytes, "%02x %02x %02x %02x", byte(0), byte(1), byte(2), byte(3));
  return {FileKind::Binary, std::string("binary data of no format qkv knows (it starts ") + first_bytes + ")"};
}

FileFormat sniff_format(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::file_status status = fs::status(path, ec);
  if (ec || !fs::exists(status)) return {FileKind::Missing, "missing (nothing is there)"};
  if (fs::is_directory(status)) {
    std::vector<std::string> names;
    for (const auto& entry : fs::directory_iterator(path, ec)) names.push_back(entry.path().filename().string());
    std::sort(names.begin(), names.end());
    if (names.empty()) return {FileKind::Directory, "an empty folder"};
    std::string listed;
    for (size_t i = 0; i < names.size() && i < 5; ++i)
      listed += (i == 0 ? "" : i + 1 == std::min<size_t>(names.size(), 5) && names.size() <= 5 ? " and " : ", ") +
                printable(names[i], 60);
    if (names.size() > 5) listed += " and " + std::to_string(names.size() - 5) + " more";
    return {FileKind::Directory, "a folder holding " + listed};
  }
  if (!fs::is_regular_file(status)) return {FileKind::Special, "not a regular file (a device, pipe or socket)"};
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return {FileKind::Missing, std::string("unreadable (") + std::strerror(errno) + ")"};
  std::byte head[4096];
  ssize_t n;
  do n = ::pread(fd, head, sizeof head, 0);
  while (n < 0 && errno == EINTR);
  ::close(fd);
  if (n < 0) return {FileKind::Missing, std::string("unreadable (") + std::strerror(errno) + ")"};
  const uintmax_t size = fs::file_size(path, ec);
  return sniff_bytes(std::span<const std::byte>(head, static_cast<size_t>(n)), ec ? UINT64_MAX : size);
}

std::string describe_file(const std::string& path) { return sniff_format(path).description; }

std::shared_ptr<unsigned char> copy_buffer(size_t bytes) {
  auto* p = static_cast<unsigned char*>(memory::allocate_block(bytes));
  if (!p) throw std::bad_alloc();
  return std::shared_ptr<unsigned char>(p, [bytes](unsigned char* q) { memory::free_block(q, bytes); });
}

}  // namespace qkv::io
