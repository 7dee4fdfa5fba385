// safetensors reading with the reference implementation's checks, and atomic writing.
#include "qkv/io/safetensors.hpp"

#include "qkv/io/file.hpp"
#include "qkv/kernels/convert.hpp"
#include "qkv/kernels/memory.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cerrno>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>

namespace qkv::io {

namespace {

constexpr uint64_t kMaxHeader = 100'000'000;  // the reference implementation's limit

[[noreturn]] void fail(const std::string& label, const std::string& problem) {
  throw IoError(label + ": " + problem);
}

bool parse_dtype(const std::string& s, DType& out) {
  static const std::pair<const char*, DType> kTable[] = {
      {"F64", DType::F64}, {"F32", DType::F32}, {"F16", DType::F16}, {"BF16", DType::BF16}, {"I64", DType::I64},
      {"I32", DType::I32}, {"I16", DType::I16}, {"I8", DType::I8},   {"U8", DType::U8},     {"BOOL", DType::BOOL}};
  for (const auto& [name, dtype] : kTable)
    if (s == name) {
      out = dtype;
      return true;
    }
  return false;
}

// IEEE half → float, exact for every half value (subnormals, infinities and NaN included).
float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exponent = (h >> 10) & 0x1fu;
  uint32_t mantissa = h & 0x3ffu;
  uint32_t bits;
  if (exponent == 0x1f) {
    bits = sign | 0x7f800000u | (mantissa << 13);
  } else if (exponent == 0) {
    if (mantissa == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      int e = -1;
      do {
        ++e;
        mantissa <<= 1;
      } while ((mantissa & 0x400u) == 0);
      bits = sign | (static_cast<uint32_t>(127 - 15 - e) << 23) | ((mantissa & 0x3ffu) << 13);
    }
  } else {
    bits = sign | ((exponent + 127 - 15) << 23) | (mantissa << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

template <typename T>
T load(const std::byte* p) {
  T v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

}  // namespace

double element_value(const std::byte* p, DType dtype) {
  switch (dtype) {
    case DType::F64: return load<double>(p);
    case DType::F32: return load<float>(p);
    case DType::F16: return half_to_float(load<uint16_t>(p));
    case DType::BF16: {
      const uint32_t bits = static_cast<uint32_t>(load<uint16_t>(p)) << 16;
      float f;
      std::memcpy(&f, &bits, sizeof f);
      return f;
    }
    case DType::I64: return static_cast<double>(load<int64_t>(p));
    case DType::I32: return load<int32_t>(p);
    case DType::I16: return load<int16_t>(p);
    case DType::I8: return load<int8_t>(p);
    case DType::U8: return load<uint8_t>(p);
    case DType::BOOL: return load<uint8_t>(p) != 0 ? 1.0 : 0.0;
  }
  return 0.0;
}

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::F64: return "F64";
    case DType::F32: return "F32";
    case DType::F16: return "F16";
    case DType::BF16: return "BF16";
    case DType::I64: return "I64";
    case DType::I32: return "I32";
    case DType::I16: return "I16";
    case DType::I8: return "I8";
    case DType::U8: return "U8";
    case DType::BOOL: return "BOOL";
  }
  return "?";
}

size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::F64: case DType::I64: return 8;
    case DType::F32: case DType::I32: return 4;
    case DType::F16: case DType::BF16: case DType::I16: return 2;
    case DType::I8: case DType::U8: case DType::BOOL: return 1;
  }
  return 0;
}

int64_t TensorInfo::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// The file's bytes: either an mmap of the file or a vector parsed from memory.
struct SafetensorsFile::Mapping {
  void* address = nullptr;
  size_t length = 0;
  int fd = -1;  // kept open: read_weights reads float32 tensors with pread, straight into their destination
  std::vector<std::byte> owned;
  ~Mapping() {
    if (address) memory::unregister_file_mapping(address), munmap(address, length);
    if (fd >= 0) ::close(fd);
  }
};

SafetensorsFile SafetensorsFile::open(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail(path, std::string("cannot open: ") + std::strerror(errno));
  struct stat st {};
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    fail(path, "not a regular file");
  }
  SafetensorsFile file;
  file.label_ = path;
  file.mapping_ = std::make_shared<Mapping>();
  const size_t size = static_cast<size_t>(st.st_size);
  const std::byte* bytes = nullptr;
  if (size > 0) {
    void* address = mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (address == MAP_FAILED) {
      ::close(fd);
      fail(path, std::string("cannot map the file: ") + std::strerror(errno));
    }
    file.mapping_->address = address;
    file.mapping_->length = size;
    memory::register_file_mapping(address, size);
    bytes = static_cast<const std::byte*>(address);
  }
  file.mapping_->fd = fd;
  file.validate(bytes, size);
  return file;
}

SafetensorsFile SafetensorsFile::parse(std::vector<std::byte> bytes, const std::string& label) {
  SafetensorsFile file;
  file.label_ = label;
  file.mapping_ = std::make_shared<Mapping>();
  file.mapping_->owned = std::move(bytes);
  file.validate(file.mapping_->owned.data(), file.mapping_->owned.size());
  return file;
}

void SafetensorsFile::validate(const std::byte* file, size_t size) {
  const std::string& label = label_;
  if (size < 8) fail(label, "file is too small to be safetensors (" + std::to_string(size) + " bytes; the header length alone takes 8)");
  const uint64_t header_length = load<uint64_t>(file);
  if (header_length > kMaxHeader) {
    // Say what the file is when its first bytes show it (text, GGUF, a zip): the usual cause is the wrong file.
    const FileFormat what = sniff_bytes({file, std::min<size_t>(size, 4096)}, size);
    fail(label, "header length " + std::to_string(header_length) + " exceeds the 100 MB limit: " +
                    (what.kind == FileKind::Binary ? std::string("not a safetensors file, or corrupt")
                                                   : "the file is " + what.description + ", not a safetensors file"));
  }
  if (header_length > size - 8) {
    fail(label, "header length " + std::to_string(header_length) + " runs past the end of the file (" +
                    std::to_string(size) + " bytes): the file is truncated");
  }
  const std::string header(reinterpret_cast<const char*>(file + 8), static_cast<size_t>(header_length));
  const uint64_t buffer_size = size - 8 - header_length;
  data_ = file + 8 + header_length;

  // Parse, rejecting duplicate top-level keys (nlohmann would silently keep the last one).
  std::set<std::string> seen;
  std::string duplicate;
  nlohmann::json json;
  try {
    json = nlohmann::json::parse(header, [&](int depth, nlohmann::json::parse_event_t event, nlohmann::json& parsed) {
      if (event == nlohmann::json::parse_event_t::key && depth == 1) {
        const std::string key = parsed.get<std::string>();
        if (!seen.insert(key).second && duplicate.empty()) duplicate = key;
      }
      return true;
    });
  } catch (const nlohmann::json::exception& e) {
    fail(label, std::string("header is not valid UTF-8 JSON: ") + printable(e.what()));
  }
  if (!duplicate.empty()) fail(label, "header lists the key '" + duplicate + "' twice");
  if (!json.is_object()) fail(label, "header must be a JSON object");

  for (auto it = json.begin(); it != json.end(); ++it) {
    const std::string& name = it.key();
    const nlohmann::json& entry = it.value();
    if (name == "__metadata__") {
      if (!entry.is_object()) fail(label, "__metadata__ must be an object of strings");
      for (auto m = entry.begin(); m != entry.end(); ++m) {
        if (!m.value().is_string()) fail(label, "__metadata__ value for '" + m.key() + "' is not a string");
        metadata_[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    auto bad = [&](const std::string& what) { fail(label, "tensor '" + name + "': " + what); };
    if (!entry.is_object()) bad("entry must be an object with dtype, shape and data_offsets");
    TensorInfo info;
    info.name = name;
    if (!entry.contains("dtype") || !entry["dtype"].is_string()) bad("missing dtype");
    const std::string dtype = entry["dtype"].get<std::string>();
    if (!parse_dtype(dtype, info.dtype)) bad("unknown dtype '" + dtype + "'");
    if (!entry.contains("shape") || !entry["shape"].is_array()) bad("missing shape");
    uint64_t count = 1;
    bool overflow = false;
    for (const auto& d : entry["shape"]) {
      if (!d.is_number_unsigned()) bad("shape entries must be non-negative integers");
      const uint64_t dim = d.get<uint64_t>();
      if (dim > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) overflow = true;
      if (dim != 0 && count > std::numeric_limits<uint64_t>::max() / dim) overflow = true;
      if (!overflow) count *= dim;
      info.shape.push_back(static_cast<int64_t>(dim));
    }
    const uint64_t element_size = dtype_size(info.dtype);
    if (overflow || count > std::numeric_limits<uint64_t>::max() / element_size) bad("shape's element count overflows");
    if (!entry.contains("data_offsets") || !entry["data_offsets"].is_array() || entry["data_offsets"].size() != 2 ||
        !entry["data_offsets"][0].is_number_unsigned() || !entry["data_offsets"][1].is_number_unsigned()) {
      bad("data_offsets must be [begin, end] with non-negative integers");
    }
    info.begin = entry["data_offsets"][0].get<uint64_t>();
    info.end = entry["data_offsets"][1].get<uint64_t>();
    if (info.end < info.begin) bad("data_offsets end before they begin");
    if (info.end - info.begin != count * element_size) {
      bad("byte range of " + std::to_string(info.end - info.begin) + " bytes does not match shape × " + dtype +
          " size = " + std::to_string(count * element_size) + " bytes");
    }
    tensors_.push_back(std::move(info));
  }
  // The buffer is covered exactly: sorted by offset, each tensor starts where the previous one ended.
  std::sort(tensors_.begin(), tensors_.end(), [](const TensorInfo& a, const TensorInfo& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  uint64_t expected = 0;
  for (const auto& t : tensors_) {
    if (t.begin < expected) fail(label, "tensor '" + t.name + "' overlaps the tensor before it");
    if (t.begin > expected) {
      fail(label, "hole of " + std::to_string(t.begin - expected) + " bytes before tensor '" + t.name + "'");
    }
    expected = t.end;
  }
  if (expected != buffer_size) {
    if (expected > buffer_size) fail(label, "tensor data runs past the end of the file: the file is truncated");
    fail(label, std::to_string(buffer_size - expected) + " trailing bytes after the last tensor");
  }
  for (size_t i = 0; i < tensors_.size(); ++i) index_.emplace(tensors_[i].name, i);
}

const TensorInfo* SafetensorsFile::find(const std::string& name) const {
  const auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

std::span<const std::byte> SafetensorsFile::bytes(const TensorInfo& info) const {
  return {data_ + info.begin, static_cast<size_t>(info.end - info.begin)};
}

namespace {
// n elements of `dtype` at p into dst as float32: one copy for F32, one vectorised pass for BF16 and F16.
void convert_to_float(const std::byte* p, DType dtype, int64_t n, float* dst) {
  if (n == 0) return;
  if (dtype == DType::F32) {
    std::memcpy(dst, p, static_cast<size_t>(n) * sizeof(float));
  } else if (dtype == DType::BF16 || dtype == DType::F16) {
    // The mapping is only byte-aligned, so the 16-bit values are copied out in blocks first; blocks go to threads
    // (a BF16 checkpoint of 600 M weights is one such pass).
    constexpr int64_t kBlock = 4096;
    const int64_t blocks = (n + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(static) if (n > (int64_t{1} << 20))
    for (int64_t b = 0; b < blocks; ++b) {
      uint16_t block[kBlock];
      const int64_t i = b * kBlock, m = std::min(kBlock, n - i);
      std::memcpy(block, p + static_cast<size_t>(i) * 2, static_cast<size_t>(m) * 2);
      if (dtype == DType::BF16) kernels::bf16_to_f32(block, dst + i, m);
      else kernels::f16_to_f32(block, dst + i, m);
    }
  } else {
    const size_t step = dtype_size(dtype);
    for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(element_value(p + static_cast<size_t>(i) * step, dtype));
  }
}
}  // namespace

Tensor SafetensorsFile::tensor(const std::string& name) const {
  const TensorInfo* info = find(name);
  if (!info) fail(label_, "has no tensor '" + name + "'");
  if (info->shape.size() > static_cast<size_t>(kMaxRank)) {
    fail(label_, "tensor '" + name + "' has " + std::to_string(info->shape.size()) + " dimensions; qkv supports up to " +
                     std::to_string(kMaxRank));
  }
  Tensor out = Tensor::empty(Shape(std::span<const int64_t>(info->shape)));
  convert_to_float(data_ + info->begin, info->dtype, info->numel(), out.data());
  return out;
}

namespace {
void require_weight_dtype(const std::string& label, const std::string& name, DType dtype) {
  if (dtype != DType::F32 && dtype != DType::F16 && dtype != DType::BF16 && dtype != DType::F64) {
    fail(label, "tensor '" + name + "' is " + dtype_name(dtype) + "; weights must be F32, F16, BF16 or F64");
  }
}
void require_finite(const std::string& label, const std::string& name, const Tensor& t) {
  const float* v = t.data();
  for (int64_t i = 0, n = t.numel(); i < n; ++i) {
    if (!std::isfinite(v[i])) {
      fail(label, "tensor '" + name + "' holds a non-finite value at element " + std::to_string(i) +
                      " (NaN, Inf, or a double beyond float's range); the weights are corrupt");
    }
  }
}
}  // namespace

Tensor SafetensorsFile::weights(const std::string& name) const {
  const TensorInfo* info = find(name);
  if (!info) fail(label_, "has no tensor '" + name + "'");
  require_weight_dtype(label_, name, info->dtype);
  Tensor t = tensor(name);
  require_finite(label_, name, t);
  return t;
}

namespace {
// Lets go of the whole pages of the file's mapping inside [begin, begin + length): they stay in the page cache, but
// this process's peak RSS need not hold the weights a second time.
void release_pages(const std::byte* begin, size_t length) {
  const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t first = (reinterpret_cast<uintptr_t>(begin) + page - 1) / page * page;
  const uintptr_t last = (reinterpret_cast<uintptr_t>(begin) + length) / page * page;
  if (last > first) madvise(reinterpret_cast<void*>(first), last - first, MADV_DONTNEED);
}

// Whether no value has an all-ones exponent (Inf or NaN). In 16-bit lanes: an exponent field of 0x7f80 plus 0x0080
// carries into bit 15, any smaller one does not, so the loop is ORs and adds the compiler vectorises (a bool per value
// was not: 0.7 s for Qwen3-0.6B's 596 M values, now about a read of them); large tensors split between the threads,
// 512 KiB at a time to whichever is free: the tokenizer is built on a thread of its own meanwhile, so one of them
// shares its core (a BF16 Qwen3-0.6B folder with its tokenizer: medians 0.116 s static, 0.108 s so).
bool bf16_finite(const uint16_t* v, int64_t n) {
  unsigned carry = 0;
#pragma omp parallel for reduction(| : carry) schedule(dynamic, 4) if (n > (int64_t{1} << 22))
  for (int64_t chunk = 0; chunk < n; chunk += int64_t{1} << 16) {
    const int64_t end = std::min(n, chunk + (int64_t{1} << 16));
    uint16_t lanes = 0;
    for (int64_t i = chunk; i < end; ++i) lanes |= static_cast<uint16_t>((v[i] & 0x7f80u) + 0x0080u);
    carry |= lanes;
  }
  return (carry & 0x8000u) == 0;
}
}  // namespace

// Into a BF16 tensor: a BF16 tensor's bytes as they are; any other dtype a chunk at a time, widened to float, checked and
// rounded, each chunk's pages let go after it, so no float32 copy of the tensor ever exists.
void SafetensorsFile::read_weights_bf16(const std::string& name, Tensor& dst) const {
  const TensorInfo* info = find(name);
  const std::byte* src = data_ + info->begin;
  const int64_t n = info->numel();
  uint16_t* out = dst.bf16_data();
  bool finite = true;
  if (info->dtype == DType::BF16) {
    std::memcpy(out, src, static_cast<size_t>(n) * 2);
    finite = bf16_finite(out, n);
  } else {
    constexpr int64_t kChunk = int64_t{1} << 20;
    const size_t step = dtype_size(info->dtype);
    std::vector<float> buffer(static_cast<size_t>(std::min(kChunk, n)));
    for (int64_t first = 0; first < n; first += kChunk) {
      const int64_t count = std::min(kChunk, n - first);
      const std::byte* chunk = src + static_cast<size_t>(first) * step;
      convert_to_float(chunk, info->dtype, count, buffer.data());
      finite = finite && kernels::all_finite(buffer.data(), count);
      kernels::f32_to_bf16(buffer.data(), out + first, count);
      if (mapping_ && mapping_->address) release_pages(chunk, static_cast<size_t>(count) * step);
    }
  }
  if (!finite) fail(label_, "tensor '" + name + "' holds a non-finite value (NaN or Inf); the weights are corrupt");
  if (mapping_ && mapping_->address) release_pages(src, static_cast<size_t>(info->end - info->begin));
}

SafetensorsFile::InPlace SafetensorsFile::bf16_in_place(const std::string& name, const Shape& shape) const {
  const TensorInfo* info = find(name);
  if (!info || info->dtype != DType::BF16 || !(Shape(std::span<const int64_t>(info->shape)) == shape) || !mapping_) return {};
  const std::byte* src = data_ + info->begin;
  if (reinterpret_cast<uintptr_t>(src) % alignof(uint16_t) != 0) return {};
  // The range's page tables filled in one call (Linux 5.14's MADV_POPULATE_READ) rather than a fault per 64 KiB as the
  // check below reads it; an older kernel refuses the advice and the faults do it.
  if (mapping_->address) {
    const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
    const uintptr_t first = reinterpret_cast<uintptr_t>(src) / page * page;
    const uintptr_t last = reinterpret_cast<uintptr_t>(src) + static_cast<uintptr_t>(info->end - info->begin);
#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22
#endif
    madvise(reinterpret_cast<void*>(first), last - first, MADV_POPULATE_READ);
  }
  if (!bf16_finite(reinterpret_cast<const uint16_t*>(src), info->numel()))
    fail(label_, "tensor '" + name + "' holds a non-finite value (NaN or Inf); the weights are corrupt");
  return {src, mapping_};
}

void SafetensorsFile::read_weights(const std::string& name, Tensor& dst) const {
  const TensorInfo* info = find(name);
  if (!info) fail(label_, "has no tensor '" + name + "'");
  require_weight_dtype(label_, name, info->dtype);
  if (!(Shape(std::span<const int64_t>(info->shape)) == dst.shape())) {
    fail(label_, "tensor '" + name + "' has shape " + Shape(std::span<const int64_t>(info->shape)).str() + ", expected " +
                     dst.shape().str());
  }
  if (dst.dtype() == qkv::DType::BF16) return read_weights_bf16(name, dst);
  const std::byte* src = data_ + info->begin;
  const size_t length = static_cast<size_t>(info->end - info->begin);
  if (info->dtype == DType::F32 && mapping_ && mapping_->fd >= 0 && mapping_->address) {
    // pread copies from the page cache into the tensor: no page of the file is mapped into this process, so loading
    // costs about what reading the file does, and peak RSS holds the weights once.
    const off_t offset = static_cast<off_t>(src - static_cast<const std::byte*>(mapping_->address));
    char* out = reinterpret_cast<char*>(dst.data());
    // Large tensors in one slice per thread: the copies, and the first touches of the fresh pages they land in, run side
    // by side. Errors are collected and reported after the loop (no exception leaves an OpenMP region).
    constexpr size_t kSlice = size_t{32} << 20;
    const int64_t slices = static_cast<int64_t>(std::max<size_t>(1, std::min<size_t>(length / kSlice, 64)));
    int error = 0;
#pragma omp parallel for schedule(static) if (slices > 1)
    for (int64_t k = 0; k < slices; ++k) {
      const size_t begin = length * static_cast<size_t>(k) / static_cast<size_t>(slices);
      const size_t end = length * static_cast<size_t>(k + 1) / static_cast<size_t>(slices);
      for (size_t done = begin; done < end;) {
        const ssize_t n = ::pread(mapping_->fd, out + done, end - done, offset + static_cast<off_t>(done));
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) {
#pragma omp atomic write
          error = n < 0 ? errno : -1;
          break;
        }
        done += static_cast<size_t>(n);
      }
    }
    if (error != 0)
      fail(label_, "cannot read tensor '" + name + "' (" + (error > 0 ? std::strerror(error) : "the file shrank") + ")");
    if (!kernels::all_finite(dst.data(), info->numel())) require_finite(label_, name, dst);
    return;
  }
  if ((info->dtype == DType::BF16 || info->dtype == DType::F16) && mapping_ && mapping_->fd >= 0 && mapping_->address) {
    // 16-bit weights: chunks read with pread into each thread's buffer and widened from there, so no page of the file
    // is mapped into this process either.
    const off_t offset = static_cast<off_t>(src - static_cast<const std::byte*>(mapping_->address));
    const int64_t n = info->numel();
    constexpr int64_t kChunk = int64_t{1} << 19;  // elements: 1 MiB of 16-bit values
    const int64_t chunks = (n + kChunk - 1) / kChunk;
    int error = 0;
#pragma omp parallel if (chunks > 1)
    {
      std::vector<uint16_t> buffer(static_cast<size_t>(std::min(kChunk, n)));
#pragma omp for schedule(static)
      for (int64_t c = 0; c < chunks; ++c) {
        const int64_t first = c * kChunk, count = std::min(kChunk, n - first);
        char* out = reinterpret_cast<char*>(buffer.data());
        const size_t bytes = static_cast<size_t>(count) * 2;
        size_t done = 0;
        while (done < bytes) {
          const ssize_t got = ::pread(mapping_->fd, out + done, bytes - done, offset + static_cast<off_t>(first * 2 + static_cast<int64_t>(done)));
          if (got < 0 && errno == EINTR) continue;
          if (got <= 0) break;
          done += static_cast<size_t>(got);
        }
        if (done < bytes) {
#pragma omp atomic write
          error = 1;
          continue;
        }
        if (info->dtype == DType::BF16) kernels::bf16_to_f32(buffer.data(), dst.data() + first, count);
        else kernels::f16_to_f32(buffer.data(), dst.data() + first, count);
      }
    }
    if (error) fail(label_, "cannot read tensor '" + name + "' (a read failed or the file shrank)");
    if (!kernels::all_finite(dst.data(), n)) require_finite(label_, name, dst);
    return;
  }
  if (info->dtype == DType::F32) {  // the copy and the finiteness check in one parallel pass
    if (!kernels::copy_finite(src, dst.data(), info->numel())) require_finite(label_, name, dst);
  } else {
    convert_to_float(src, info->dtype, info->numel(), dst.data());
    require_finite(label_, name, dst);
  }
  // The file's pages are in the page cache; this process need not keep them mapped too (peak RSS would hold the
  // weights twice). Only whole pages inside the tensor's bytes are released.
  if (mapping_ && mapping_->address) release_pages(src, length);
}

std::vector<int64_t> SafetensorsFile::int64s(const std::string& name) const {
  const TensorInfo* info = find(name);
  if (!info) fail(label_, "has no tensor '" + name + "'");
  std::vector<int64_t> out(static_cast<size_t>(info->numel()));
  const std::byte* p = data_ + info->begin;
  const size_t step = dtype_size(info->dtype);
  for (size_t i = 0; i < out.size(); ++i) {
    if (info->dtype == DType::I64) {
      out[i] = load<int64_t>(p + i * step);
      continue;
    }
    const double v = element_value(p + i * step, info->dtype);
    // Only whole numbers that int64 holds: casting NaN or 1e300 would be undefined.
    if (!(v >= -9.2233720368547758e18 && v < 9.2233720368547758e18) || v != std::trunc(v)) {
      fail(label_, "tensor '" + name + "' element " + std::to_string(i) + " = " + std::to_string(v) +
                       " is not a whole number in int64's range");
    }
    out[i] = static_cast<int64_t>(v);
  }
  return out;
}

TensorData TensorData::from_tensor_bf16(std::string name, const Tensor& t) {
  TensorData d;
  d.name = std::move(name);
  d.dtype = DType::BF16;
  d.shape.assign(t.shape().dims().begin(), t.shape().dims().end());
  d.bytes.resize(static_cast<size_t>(t.numel()) * 2);
  if (t.numel() > 0 && t.dtype() == qkv::DType::BF16) {
    std::memcpy(d.bytes.data(), t.bf16(), d.bytes.size());  // a BF16 tensor's own values, as they are
  } else if (t.numel() > 0) {  // rounded here, not through Tensor::bf16 (whose copy would stay with the tensor)
    std::vector<uint16_t> bits(static_cast<size_t>(t.numel()));
    kernels::f32_to_bf16(t.data(), bits.data(), t.numel());
    std::memcpy(d.bytes.data(), bits.data(), d.bytes.size());
  }
  return d;
}

TensorData TensorData::from_tensor(std::string name, const Tensor& t) {
  TensorData d;
  d.name = std::move(name);
  d.dtype = DType::F32;
  d.shape.assign(t.shape().dims().begin(), t.shape().dims().end());
  if (t.numel() > 0 && t.dtype() == qkv::DType::BF16) {  // widened exactly
    std::vector<float> values(static_cast<size_t>(t.numel()));
    kernels::bf16_to_f32(t.bf16(), values.data(), t.numel());
    const auto* p = reinterpret_cast<const std::byte*>(values.data());
    d.bytes.assign(p, p + t.numel() * static_cast<int64_t>(sizeof(float)));
  } else if (t.numel() > 0) {  // an empty tensor has no bytes to copy (and its data pointer is not to be read)
    const auto* p = reinterpret_cast<const std::byte*>(t.data());
    d.bytes.assign(p, p + t.numel() * static_cast<int64_t>(sizeof(float)));
  }
  return d;
}

TensorData TensorData::from_int64s(std::string name, std::span<const int64_t> values) {
  TensorData d;
  d.name = std::move(name);
  d.dtype = DType::I64;
  d.shape = {static_cast<int64_t>(values.size())};
  if (!values.empty()) {
    const auto* p = reinterpret_cast<const std::byte*>(values.data());
    d.bytes.assign(p, p + values.size() * sizeof(int64_t));
  }
  return d;
}

void save_safetensors(const std::string& path, const std::vector<TensorData>& tensors,
                      const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  std::set<std::string> names;
  for (const auto& t : tensors) {
    if (!names.insert(t.name).second) throw IoError(path + ": two tensors are named '" + t.name + "'");
    header[t.name] = {{"dtype", dtype_name(t.dtype)}, {"shape", t.shape}, {"data_offsets", {offset, offset + t.bytes.size()}}};
    offset += t.bytes.size();
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // keep the buffer 8-byte aligned, as the reference writer does
  std::vector<std::byte> file(8 + text.size() + offset);
  const uint64_t length = text.size();
  std::memcpy(file.data(), &length, 8);
  std::memcpy(file.data() + 8, text.data(), text.size());
  size_t at = 8 + text.size();
  for (const auto& t : tensors) {
    if (!t.bytes.empty()) std::memcpy(file.data() + at, t.bytes.data(), t.bytes.size());
    at += t.bytes.size();
  }
  write_file_atomically(path, file);
}

void save_safetensors(const std::string& path, const std::vector<std::pair<std::string, Tensor>>& tensors,
                      const std::map<std::string, std::string>& metadata) {
  std::vector<TensorData> data;
  data.reserve(tensors.size());
  for (const auto& [name, t] : tensors) data.push_back(TensorData::from_tensor(name, t));
  save_safetensors(path, data, metadata);
}

void mxfp4_blocks_from_hf(const std::byte* blocks, const std::byte* scales, int64_t groups, unsigned char* out) {
  const auto* in = reinterpret_cast<const unsigned char*>(blocks);
  const auto* e = reinterpret_cast<const unsigned char*>(scales);
  // value v of a group: byte v / 2 of its 16, low nibble for even v
  auto code = [](const unsigned char* group, int v) { return (group[v / 2] >> (4 * (v % 2))) & 0x0f; };
#pragma omp parallel for schedule(static) if (groups > 65536)
  for (int64_t g = 0; g < groups; ++g) {
    const unsigned char* group = in + g * 16;
    unsigned char* block = out + g * 17;
    block[0] = e[g];
    for (int j = 0; j < 16; ++j) block[1 + j] = static_cast<unsigned char>(code(group, j) | (code(group, j + 16) << 4));
  }
}

}  // namespace qkv::io
