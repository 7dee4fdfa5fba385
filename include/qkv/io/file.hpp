// Whole files: read into memory, mapped read-only, or written atomically (temp file beside the target, fsync,
// rename), so an existing file is either kept whole or replaced whole, never left half-written.
// Not here: what the bytes mean (safetensors.hpp, gguf.hpp, npy.hpp, pth.hpp parse and validate them).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace qkv::io {

// Reads a whole file (also a pipe, FIFO, <(…) or a terminal); throws IoError naming it. A device that never ends
// (/dev/zero, /dev/urandom) is refused, and so is anything longer than max_bytes (checked before reading a
// regular file, while reading a stream), with a message that states the limit.
std::vector<std::byte> read_file(const std::string& path, uint64_t max_bytes = UINT64_MAX);

// Writes `bytes` to `path` atomically: a temporary file beside it (path.tmp.<pid>), fsync, rename. A symbolic
// link is followed (its target is replaced, the link stays); a device, pipe or socket (/dev/null, a FIFO) is
// written in place, never replaced by a regular file. Throws IoError naming the path.
void write_file_atomically(const std::string& path, std::span<const std::byte> bytes);

// The same, streamed: bytes are appended as they are made (a quantized model written layer by layer never has the
// whole file in memory), and the file appears at `path` only when commit() returns. Destroyed without commit()
// (an exception on the way), the temporary is removed and an existing file at `path` is untouched. The same
// rules as write_file_atomically for symbolic links and devices (a device is written in place as bytes come).
class AtomicFileWriter {
 public:
  // Creates path.tmp.<pid> (or opens the device); throws IoError naming `path`.
  explicit AtomicFileWriter(const std::string& path);
  AtomicFileWriter(const AtomicFileWriter&) = delete;
  AtomicFileWriter& operator=(const AtomicFileWriter&) = delete;
  ~AtomicFileWriter();

  void write(std::span<const std::byte> bytes);  // Appends (buffered); IoError on a failed write.
  void write_zeros(uint64_t count);  // Appends `count` zero bytes (padding).
  uint64_t written() const { return written_; }  // Bytes appended so far
  // Flushes, fsyncs and renames the temporary onto `path`; IoError if any step fails (the temporary is removed).
  void commit();

 private:
  void flush_buffer();
  void abandon() noexcept;
  std::string path_given_, path_, temp_;  // as given; the file to replace; the temporary ("" for a device)
  int fd_ = -1;
  uint64_t written_ = 0;
  std::vector<std::byte> buffer_;
};

// How a mapped file will be read, passed to the kernel as madvise(2) hints (which read ahead, or not).
enum class MapAccess {
  Normal,      // the kernel's default read-ahead
  Sequential,  // read once, front to back: aggressive read-ahead, pages dropped early
  Random,      // read here and there (a tensor at a time, in any order): no read-ahead
  WillNeed,    // read all of it soon: start reading the whole file into the page cache now
};

// A buffer for a loader's copy of a file's bytes (rearranged, or converted to another layout): from the kernels' block
// allocator (huge pages from 4 MiB on), not zeroed — it is written whole, and zeroing would touch every page once
// more — and given back when the last owner goes. std::bad_alloc if refused.
std::shared_ptr<unsigned char> copy_buffer(size_t bytes);

// A whole file mapped read-only (mmap PROT_READ, MAP_PRIVATE): its bytes are the page cache's, shared with every
// process that maps it and never copied, so a model used in place costs its file size in resident memory, paid
// page by page as it is read. Moveable, not copyable; unmapped and closed when destroyed. The file descriptor stays
// open so that a loader can also pread() from it (a copy into memory it owns, without mapping those pages).
// Not here: parsing (the formats' readers hold a MappedFile); a file changed by someone else while mapped is not
// detected (a file shortened under the mapping makes reads past its new end fault, as with any mmap reader).
class MappedFile {
 public:
  MappedFile() = default;
  // Maps `path`; IoError naming it if it cannot be opened, is not a regular file, or cannot be mapped. An empty file
  // maps to size() == 0 and data() == nullptr.
  static MappedFile open(const std::string& path, MapAccess access = MapAccess::Normal);
  MappedFile(MappedFile&& other) noexcept;
  MappedFile& operator=(MappedFile&& other) noexcept;
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  ~MappedFile();

  const std::byte* data() const { return data_; }  // The first byte (nullptr when empty)
  size_t size() const { return size_; }  // The file's length in bytes, as it was when mapped
  std::span<const std::byte> bytes() const { return {data_, size_}; }  // All of it
  const std::string& path() const { return path_; }  // The path it was opened from
  int fd() const { return fd_; }  // The open descriptor (for pread), -1 when nothing is mapped

  // An madvise hint for the whole pages inside [offset, offset + length) (clipped to the file).
  void advise(uint64_t offset, uint64_t length, MapAccess access) const;
  // Lets go of the whole pages inside [offset, offset + length): they stay in the page cache, but no longer count
  // in this process's resident memory (used after copying a tensor out, so the weights are not held twice).
  void release(uint64_t offset, uint64_t length) const;

 private:
  void reset() noexcept;
  std::string path_;
  const std::byte* data_ = nullptr;
  size_t size_ = 0;
  int fd_ = -1;
};

// Removes path.tmp.<pid> files left by processes that no longer run (a killed writer); returns how many.
int remove_stale_temporaries(const std::string& path);

// What a file is, from its first bytes: for messages that name it when it is not what was expected ("UTF-8 text, not
// a safetensors file"). Not a validator: a file sniffed as safetensors may still be corrupt.
enum class FileKind {
  Missing, Directory, Special,  // nothing there; a folder; a device, pipe or socket
  Empty, Text, Json,            // no bytes; UTF-8 text; text that opens with { or [
  Safetensors, Gguf, Zip, Pickle, Npy, Gzip, Binary,
};
// A file's kind and a phrase that names it.
struct FileFormat {
  FileKind kind = FileKind::Binary;  // what the first bytes say it is
  // "UTF-8 text (\"In the beginning God…\")", "a GGUF file (version 3, llama.cpp's format)", "a folder holding
  // model.safetensors and tokenizer.json": a phrase to follow "is".
  std::string description;
};
// Reads at most the first 4 KiB (and, for a folder, its names); never throws.
FileFormat sniff_format(const std::string& path);
// The same for bytes already read (the start of a file); `total_size`, when known, tells a safetensors header
// that fits the file from one that cannot.
FileFormat sniff_bytes(std::span<const std::byte> head, uint64_t total_size = UINT64_MAX);
// sniff_format(path).description.
std::string describe_file(const std::string& path);

}  // namespace qkv::io
