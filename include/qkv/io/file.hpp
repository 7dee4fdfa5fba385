// Whole files: read into memory, or written atomically (temp file beside the target, fsync, rename), so an
// existing file is either kept whole or replaced whole, never left half-written.
#pragma once

#include <cstddef>
#include <span>
#include <string>
#include <vector>

namespace qkv::io {

// Reads a whole file (also a pipe, FIFO or <(…)); throws IoError naming it.
std::vector<std::byte> read_file(const std::string& path);

// Writes `bytes` to `path` atomically: a temporary file beside it (path.tmp.<pid>), fsync, rename. A symbolic
// link is followed (its target is replaced, the link stays); a device, pipe or socket (/dev/null, a FIFO) is
// written in place, never replaced by a regular file. Throws IoError naming the path.
void write_file_atomically(const std::string& path, std::span<const std::byte> bytes);

// Removes path.tmp.<pid> files left by processes that no longer run (a killed writer); returns how many.
int remove_stale_temporaries(const std::string& path);

}  // namespace qkv::io
