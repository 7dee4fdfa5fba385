// Whole files: read into memory, or written atomically (temp file beside the target, fsync, rename), so an
// existing file is either kept whole or replaced whole, never left half-written.
#pragma once

#include <cstddef>
#include <span>
#include <string>
#include <vector>

namespace qkv::io {

// Reads a whole file; throws IoError naming it.
std::vector<std::byte> read_file(const std::string& path);

// Writes `bytes` to `path` atomically (temp file, fsync, rename). Throws IoError naming the path.
void write_file_atomically(const std::string& path, std::span<const std::byte> bytes);

}  // namespace qkv::io
