// Whole files: read into memory, or written atomically (temp file beside the target, fsync, rename), so an
// existing file is either kept whole or replaced whole, never left half-written.
#pragma once

#include <cstddef>
#include <cstdint>
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

// Removes path.tmp.<pid> files left by processes that no longer run (a killed writer); returns how many.
int remove_stale_temporaries(const std::string& path);

// What a file is, from its first bytes: for messages that name it when it is not what was expected ("UTF-8 text, not
// a safetensors file"). Not a validator: a file sniffed as safetensors may still be corrupt.
enum class FileKind {
  Missing, Directory, Special,  // nothing there; a folder; a device, pipe or socket
  Empty, Text, Json,            // no bytes; UTF-8 text; text that opens with { or [
  Safetensors, Gguf, Zip, Pickle, Npy, Gzip, Binary,
};
struct FileFormat {
  FileKind kind = FileKind::Binary;
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
