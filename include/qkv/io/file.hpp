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

}  // namespace qkv::io
