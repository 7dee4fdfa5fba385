// NumPy .npy files: versions 1.0, 2.0 and 3.0; dtypes '<f4', '<f8', '<i8', '<i4'; C order only.
// Reading converts to float32 tensors (integers too, for inputs such as token ids).
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "qkv/core/tensor.hpp"
#include "qkv/io/file.hpp"

namespace qkv::io {

// Throws IoError naming the file and the problem (bad magic, bad header dict, Fortran order, truncated…).
Tensor load_npy(const std::string& path);
Tensor parse_npy(const std::vector<std::byte>& bytes, const std::string& label = "<memory>");
// Writes version 1.0, '<f4', C order, header padded to 64 bytes; atomically.
void save_npy(const std::string& path, const Tensor& t);

}  // namespace qkv::io
