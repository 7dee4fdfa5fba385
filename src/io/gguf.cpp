// GGUF reading (every count, length, shape and offset checked against the bytes left before it sizes anything)
// and streamed writing; see qkv/io/gguf.hpp. ggml's docs/gguf.md and src/gguf.cpp are the specification.
#include "qkv/io/gguf.hpp"

#include <algorithm>
#include <bit>
#include <cstring>
#include <limits>
#include <numeric>
#include <string>
#include <type_traits>
#include <unordered_set>

#include "qkv/core/error.hpp"

namespace qkv::io {

static_assert(std::endian::native == std::endian::little, "GGUF values are read as little-endian host values");

// ---------------------------------------------------------------------------------------------------------------
// The table of ggml types: block sizes and bytes per block from ggml's type_traits (ggml.c) and the block structs
// of ggml-common.h (QK_K = 256).

namespace {

constexpr GgmlTypeInfo kGgmlTypes[] = {
    {GgmlType::F32, "F32", 1, 4},
    {GgmlType::F16, "F16", 1, 2},
    {GgmlType::Q4_0, "Q4_0", 32, 2 + 16},  // f16 scale, 32 nibbles
    {GgmlType::Q4_1, "Q4_1", 32, 2 + 2 + 16},  // f16 scale and minimum, 32 nibbles
    {GgmlType::Q5_0, "Q5_0", 32, 2 + 4 + 16},  // f16 scale, 32 high bits, 32 nibbles
    {GgmlType::Q5_1, "Q5_1", 32, 2 + 2 + 4 + 16},
    {GgmlType::Q8_0, "Q8_0", 32, 2 + 32},  // f16 scale, 32 bytes
    {GgmlType::Q8_1, "Q8_1", 32, 2 + 2 + 32},  // f16 scale and sum, 32 bytes
    {GgmlType::Q2_K, "Q2_K", 256, 2 + 2 + 16 + 64},
    {GgmlType::Q3_K, "Q3_K", 256, 2 + 64 + 32 + 12},
    {GgmlType::Q4_K, "Q4_K", 256, 2 + 2 + 12 + 128},  // f16 d and dmin, 12 bytes of 6-bit scales, nibbles
    {GgmlType::Q5_K, "Q5_K", 256, 2 + 2 + 12 + 128 + 32},
    {GgmlType::Q6_K, "Q6_K", 256, 2 + 16 + 192},  // f16 d, 16 int8 scales, 4 + 2 bits per element
    {GgmlType::Q8_K, "Q8_K", 256, 4 + 256 + 32},  // f32 d, 256 bytes, 16 int16 sums
    {GgmlType::IQ2_XXS, "IQ2_XXS", 256, 2 + 64},
    {GgmlType::IQ2_XS, "IQ2_XS", 256, 2 + 64 + 8},
    {GgmlType::IQ3_XXS, "IQ3_XXS", 256, 2 + 96},
    {GgmlType::IQ1_S, "IQ1_S", 256, 2 + 32 + 16},
    {GgmlType::IQ4_NL, "IQ4_NL", 32, 2 + 16},
    {GgmlType::IQ3_S, "IQ3_S", 256, 2 + 104 + 4},
    {GgmlType::IQ2_S, "IQ2_S", 256, 2 + 64 + 16},
    {GgmlType::IQ4_XS, "IQ4_XS", 256, 2 + 2 + 4 + 128},
    {GgmlType::I8, "I8", 1, 1},
    {GgmlType::I16, "I16", 1, 2},
    {GgmlType::I32, "I32", 1, 4},
    {GgmlType::I64, "I64", 1, 8},
    {GgmlType::F64, "F64", 1, 8},
    {GgmlType::IQ1_M, "IQ1_M", 256, 32 + 16 + 8},
    {GgmlType::BF16, "BF16", 1, 2},
    {GgmlType::TQ1_0, "TQ1_0", 256, 48 + 4 + 2},
    {GgmlType::TQ2_0, "TQ2_0", 256, 64 + 2},
    {GgmlType::MXFP4, "MXFP4", 32, 1 + 16},  // e8m0 scale, 32 fp4 nibbles
    {GgmlType::NVFP4, "NVFP4", 64, 4 + 32},  // 4 e4m3 scales, 64 fp4 nibbles
    {GgmlType::Q1_0, "Q1_0", 128, 2 + 16},
    {GgmlType::Q2_0, "Q2_0", 64, 2 + 16},
};

// Ids ggml once had and removed (their tensors were repacked at run time instead); named so a file using one gets
// a message saying so rather than "unknown".
const char* removed_type_name(uint32_t id) {
  switch (id) {
    case 4: return "Q4_2";
    case 5: return "Q4_3";
    case 31: return "Q4_0_4_4";
    case 32: return "Q4_0_4_8";
    case 33: return "Q4_0_8_8";
    case 36: return "IQ4_NL_4_4";
    case 37: return "IQ4_NL_4_8";
    case 38: return "IQ4_NL_8_8";
    default: return nullptr;
  }
}

}  // namespace

const GgmlTypeInfo* ggml_type_info(uint32_t id) {
  for (const GgmlTypeInfo& info : kGgmlTypes)
    if (static_cast<uint32_t>(info.type) == id) return &info;
  return nullptr;
}

std::span<const GgmlTypeInfo> ggml_types() { return kGgmlTypes; }

std::string ggml_type_name(uint32_t id) {
  if (const GgmlTypeInfo* info = ggml_type_info(id)) return info->name;
  if (const char* removed = removed_type_name(id)) return std::string("removed type ") + removed;
  return "ggml type " + std::to_string(id) + " (unknown)";
}

uint64_t ggml_bytes(GgmlType type, uint64_t elements) {
  const GgmlTypeInfo* info = ggml_type_info(static_cast<uint32_t>(type));
  QKV_CHECK(info != nullptr, "ggml_bytes of a type with no layout");
  return elements / static_cast<uint64_t>(info->block_size) * static_cast<uint64_t>(info->block_bytes);
}

const char* gguf_type_name(GgufType type) {
  switch (type) {
    case GgufType::U8: return "u8";
    case GgufType::I8: return "i8";
    case GgufType::U16: return "u16";
    case GgufType::I16: return "i16";
    case GgufType::U32: return "u32";
    case GgufType::I32: return "i32";
    case GgufType::F32: return "f32";
    case GgufType::Bool: return "bool";
    case GgufType::String: return "str";
    case GgufType::Array: return "arr";
    case GgufType::U64: return "u64";
    case GgufType::I64: return "i64";
    case GgufType::F64: return "f64";
  }
  return "type ?";
}

// ---------------------------------------------------------------------------------------------------------------
// GgufValue

namespace {

// Bytes of one element of a fixed-size type; 0 for str and arr (whose elements carry their own lengths).
size_t fixed_size(GgufType type) {
  switch (type) {
    case GgufType::U8: case GgufType::I8: case GgufType::Bool: return 1;
    case GgufType::U16: case GgufType::I16: return 2;
    case GgufType::U32: case GgufType::I32: case GgufType::F32: return 4;
    case GgufType::U64: case GgufType::I64: case GgufType::F64: return 8;
    case GgufType::String: case GgufType::Array: return 0;
  }
  return 0;
}

bool valid_type(uint32_t id) { return id <= static_cast<uint32_t>(GgufType::F64); }

bool integer_type(GgufType type) {
  switch (type) {
    case GgufType::U8: case GgufType::I8: case GgufType::U16: case GgufType::I16: case GgufType::U32:
    case GgufType::I32: case GgufType::U64: case GgufType::I64: return true;
    default: return false;
  }
}
bool signed_type(GgufType type) {
  return type == GgufType::I8 || type == GgufType::I16 || type == GgufType::I32 || type == GgufType::I64;
}

// Sign- or zero-extends `size` little-endian bytes of an integer of `type` into 64 bits.
uint64_t widen(const std::byte* p, GgufType type) {
  switch (type) {
    case GgufType::U8: return std::to_integer<uint8_t>(p[0]);
    case GgufType::I8: return static_cast<uint64_t>(static_cast<int64_t>(static_cast<int8_t>(std::to_integer<uint8_t>(p[0]))));
    case GgufType::U16: { uint16_t v; std::memcpy(&v, p, 2); return v; }
    case GgufType::I16: { int16_t v; std::memcpy(&v, p, 2); return static_cast<uint64_t>(static_cast<int64_t>(v)); }
    case GgufType::U32: { uint32_t v; std::memcpy(&v, p, 4); return v; }
    case GgufType::I32: { int32_t v; std::memcpy(&v, p, 4); return static_cast<uint64_t>(static_cast<int64_t>(v)); }
    default: { uint64_t v; std::memcpy(&v, p, 8); return v; }
  }
}

[[noreturn]] void value_error(const GgufValue& v, const std::string& expected) {
  throw ValueError("a GGUF value of type " + v.type_text() + " was read as " + expected);
}

// An integer's 64 bits (widened) as int64; ValueError for a u64 above 2^63 - 1.
int64_t to_int64(uint64_t bits, GgufType type) {
  if (type == GgufType::U64 && bits > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
    throw ValueError("the u64 value " + std::to_string(bits) + " is beyond int64's range");
  return static_cast<int64_t>(bits);
}

}  // namespace

template <typename T>
GgufValue GgufValue::scalar(GgufType type, T v) {
  GgufValue out;
  out.type_ = type;
  std::memcpy(&out.bits_, &v, sizeof v);
  return out;
}

template <typename T>
GgufValue GgufValue::packed(GgufType element, std::span<const T> v) {
  GgufValue out;
  out.type_ = GgufType::Array;
  out.element_ = element;
  std::vector<std::byte> bytes(v.size() * sizeof(T));
  if (!v.empty()) std::memcpy(bytes.data(), v.data(), bytes.size());
  out.payload_ = own(std::move(bytes), v.size());
  return out;
}

GgufValue::Packed GgufValue::own(std::vector<std::byte> bytes, uint64_t count) {
  auto owner = std::make_shared<const std::vector<std::byte>>(std::move(bytes));
  const std::span<const std::byte> span(*owner);
  return Packed{std::move(owner), span, count};
}

bool GgufValue::Packed::operator==(const Packed& other) const {
  return count == other.count && bytes.size() == other.bytes.size() &&
         (bytes.empty() || std::memcmp(bytes.data(), other.bytes.data(), bytes.size()) == 0);
}

GgufValue GgufValue::u8(uint8_t v) { return scalar(GgufType::U8, v); }
GgufValue GgufValue::i8(int8_t v) { return scalar(GgufType::I8, v); }
GgufValue GgufValue::u16(uint16_t v) { return scalar(GgufType::U16, v); }
GgufValue GgufValue::i16(int16_t v) { return scalar(GgufType::I16, v); }
GgufValue GgufValue::u32(uint32_t v) { return scalar(GgufType::U32, v); }
GgufValue GgufValue::i32(int32_t v) { return scalar(GgufType::I32, v); }
GgufValue GgufValue::f32(float v) { return scalar(GgufType::F32, v); }
GgufValue GgufValue::boolean(bool v) { return scalar(GgufType::Bool, static_cast<uint8_t>(v ? 1 : 0)); }
GgufValue GgufValue::u64(uint64_t v) { return scalar(GgufType::U64, v); }
GgufValue GgufValue::i64(int64_t v) { return scalar(GgufType::I64, v); }
GgufValue GgufValue::f64(double v) { return scalar(GgufType::F64, v); }
GgufValue GgufValue::string(std::string v) {
  GgufValue out;
  out.type_ = GgufType::String;
  out.payload_ = std::move(v);
  return out;
}
GgufValue GgufValue::u8s(std::span<const uint8_t> v) { return packed(GgufType::U8, v); }
GgufValue GgufValue::i8s(std::span<const int8_t> v) { return packed(GgufType::I8, v); }
GgufValue GgufValue::u16s(std::span<const uint16_t> v) { return packed(GgufType::U16, v); }
GgufValue GgufValue::i16s(std::span<const int16_t> v) { return packed(GgufType::I16, v); }
GgufValue GgufValue::u32s(std::span<const uint32_t> v) { return packed(GgufType::U32, v); }
GgufValue GgufValue::i32s(std::span<const int32_t> v) { return packed(GgufType::I32, v); }
GgufValue GgufValue::f32s(std::span<const float> v) { return packed(GgufType::F32, v); }
GgufValue GgufValue::u64s(std::span<const uint64_t> v) { return packed(GgufType::U64, v); }
GgufValue GgufValue::i64s(std::span<const int64_t> v) { return packed(GgufType::I64, v); }
GgufValue GgufValue::f64s(std::span<const double> v) { return packed(GgufType::F64, v); }
GgufValue GgufValue::booleans(const std::vector<bool>& v) {
  std::vector<uint8_t> bytes(v.begin(), v.end());
  return packed(GgufType::Bool, std::span<const uint8_t>(bytes));
}
GgufValue GgufValue::strings(std::vector<std::string> v) {
  GgufValue out;
  out.type_ = GgufType::Array;
  out.element_ = GgufType::String;
  size_t total = 0;
  for (const std::string& item : v) total += sizeof(uint64_t) + item.size();
  std::vector<std::byte> bytes(total);
  std::byte* at = bytes.data();
  for (const std::string& item : v) {
    const uint64_t length = item.size();
    std::memcpy(at, &length, sizeof length);
    if (length) std::memcpy(at + sizeof length, item.data(), item.size());
    at += sizeof length + item.size();
  }
  out.payload_ = own(std::move(bytes), v.size());
  return out;
}
GgufValue GgufValue::arrays(std::vector<GgufValue> v) {
  for (const GgufValue& item : v)
    if (!item.is_array()) throw ValueError("an array of arrays was given a " + item.type_text() + " element");
  GgufValue out;
  out.type_ = GgufType::Array;
  out.element_ = GgufType::Array;
  out.payload_ = std::move(v);
  return out;
}
GgufValue GgufValue::empty_array(GgufType element) {
  if (!valid_type(static_cast<uint32_t>(element))) throw ValueError("an array of an unknown GGUF type");
  if (element == GgufType::String) return strings({});
  if (element == GgufType::Array) return arrays({});
  GgufValue out;
  out.type_ = GgufType::Array;
  out.element_ = element;
  out.payload_ = own({}, 0);
  return out;
}

bool GgufValue::is_integer() const { return integer_type(type_); }

uint64_t GgufValue::size() const {
  if (!is_array()) return 1;
  if (element_ == GgufType::Array) return std::get<std::vector<GgufValue>>(payload_).size();
  return std::get<Packed>(payload_).count;
}

std::string GgufValue::type_text() const {
  if (!is_array()) return gguf_type_name(type_);
  return std::string("array of ") + (element_ == GgufType::Array ? "array" : gguf_type_name(element_));
}

int64_t GgufValue::as_int64() const {
  if (!is_integer()) value_error(*this, "an integer");
  return to_int64(widen(reinterpret_cast<const std::byte*>(&bits_), type_), type_);
}

uint64_t GgufValue::as_uint64() const {
  if (!is_integer()) value_error(*this, "an integer");
  const uint64_t wide = widen(reinterpret_cast<const std::byte*>(&bits_), type_);
  if (signed_type(type_) && static_cast<int64_t>(wide) < 0)
    throw ValueError("the " + type_text() + " value " + std::to_string(static_cast<int64_t>(wide)) + " is negative");
  return wide;
}

double GgufValue::as_double() const {
  if (type_ == GgufType::F32) {
    float f;
    std::memcpy(&f, &bits_, sizeof f);
    return f;
  }
  if (type_ == GgufType::F64) return std::bit_cast<double>(bits_);
  value_error(*this, "a float");
}

bool GgufValue::as_bool() const {
  if (type_ != GgufType::Bool) value_error(*this, "a bool");
  return bits_ != 0;
}

const std::string& GgufValue::as_string() const {
  if (type_ != GgufType::String) value_error(*this, "a string");
  return std::get<std::string>(payload_);
}

std::vector<int64_t> GgufValue::as_int64s() const {
  if (!is_array() || !integer_type(element_)) value_error(*this, "an array of integers");
  const std::span<const std::byte> bytes = std::get<Packed>(payload_).bytes;
  const size_t step = fixed_size(element_);
  std::vector<int64_t> out(bytes.size() / step);
  for (size_t i = 0; i < out.size(); ++i) out[i] = to_int64(widen(bytes.data() + i * step, element_), element_);
  return out;
}

std::vector<double> GgufValue::as_doubles() const {
  if (!is_array() || (element_ != GgufType::F32 && element_ != GgufType::F64)) value_error(*this, "an array of floats");
  const std::span<const std::byte> bytes = std::get<Packed>(payload_).bytes;
  std::vector<double> out(bytes.size() / fixed_size(element_));
  for (size_t i = 0; i < out.size(); ++i) {
    if (element_ == GgufType::F32) {
      float f;
      std::memcpy(&f, bytes.data() + i * 4, 4);
      out[i] = f;
    } else {
      std::memcpy(&out[i], bytes.data() + i * 8, 8);
    }
  }
  return out;
}

std::vector<float> GgufValue::as_floats() const {
  if (is_array() && element_ == GgufType::F32) {  // the common case (token scores): one copy
    const std::span<const std::byte> bytes = std::get<Packed>(payload_).bytes;
    std::vector<float> out(bytes.size() / 4);
    if (!out.empty()) std::memcpy(out.data(), bytes.data(), bytes.size());
    return out;
  }
  const std::vector<double> wide = as_doubles();
  return std::vector<float>(wide.begin(), wide.end());
}

std::vector<std::string> GgufValue::as_strings() const { return string_list().to_vector(); }

GgufStrings GgufValue::string_list() const {
  if (!is_array() || element_ != GgufType::String) value_error(*this, "an array of strings");
  const Packed& p = std::get<Packed>(payload_);
  return GgufStrings(p.bytes, p.count);
}

const std::vector<GgufValue>& GgufValue::as_arrays() const {
  if (!is_array() || element_ != GgufType::Array) value_error(*this, "an array of arrays");
  return std::get<std::vector<GgufValue>>(payload_);
}

std::span<const std::byte> GgufValue::raw() const {
  const auto* p = std::get_if<Packed>(&payload_);
  return p && element_ != GgufType::String ? p->bytes : std::span<const std::byte>();
}

bool GgufValue::operator==(const GgufValue& other) const {
  if (type_ != other.type_) return false;
  if (!is_array()) return type_ == GgufType::String ? as_string() == other.as_string() : bits_ == other.bits_;
  return element_ == other.element_ && payload_ == other.payload_;
}

// ---------------------------------------------------------------------------------------------------------------
// Reading

namespace {
constexpr uint64_t kMaxKeyLength = 65535;  // docs/gguf.md: keys are at most 2^16 - 1 bytes
constexpr uint64_t kMaxNameLength = 64;  // docs/gguf.md: tensor names are at most 64 bytes
constexpr int kMaxDims = 4;  // GGML_MAX_DIMS
constexpr int kMaxNesting = 64;  // arrays of arrays: any real file nests 1 deep; this bounds the recursion
// The fewest bytes one metadata entry (u64 key length, a 1-byte key, u32 type, a 1-byte value) and one tensor
// entry (u64 name length, a 1-byte name, u32 n_dims, no dims, u32 type, u64 offset) can take: the counts in the
// header are checked against the bytes left with these before anything is sized by them.
constexpr uint64_t kMinMetadataBytes = 8 + 1 + 4 + 1;
constexpr uint64_t kMinTensorBytes = 8 + 1 + 4 + 4 + 8;

std::string count_text(uint64_t n, const char* one, const char* many) {
  return std::to_string(n) + " " + (n == 1 ? one : many);
}

uint64_t align_up(uint64_t offset, uint64_t alignment) { return (offset + alignment - 1) / alignment * alignment; }
}  // namespace

// What a read is of, for the message when it fails: a string, or a callable that makes one. A tokenizer's metadata
// holds 300,000 strings; naming each ("metadata 'tokenizer.ggml.tokens'[123]") before reading it took longer than
// reading them.
std::string name_of(const std::string& what) { return what; }
template <typename What>
  requires std::is_invocable_r_v<std::string, const What&>
std::string name_of(const What& what) { return what(); }

// A cursor over the file's bytes: every read checks the bytes left first and names what it was reading.
class GgufReader {
 public:
  // `owner` keeps `bytes` alive: arrays read stay in them.
  GgufReader(std::shared_ptr<const void> owner, const std::byte* bytes, size_t size, const std::string& label)
      : owner_(std::move(owner)), p_(bytes), size_(size), label_(label) {}

  [[noreturn]] void fail(const std::string& problem) const { throw IoError(label_ + ": " + problem); }

  uint64_t at() const { return at_; }
  uint64_t left() const { return size_ - at_; }

  template <typename What>
  void need(uint64_t n, const What& what) const {
    if (n > left()) {
      fail("truncated: " + name_of(what) + " needs " + count_text(n, "byte", "bytes") + " at offset " + std::to_string(at_) +
           ", but the file ends at " + std::to_string(size_) + "; the file is cut short (download or copy it again)");
    }
  }

  template <typename T, typename What>
  T read(const What& what) {
    need(sizeof(T), what);
    T v;
    std::memcpy(&v, p_ + at_, sizeof v);
    at_ += sizeof v;
    return v;
  }

  // A GGUF string (u64 length, bytes), where it lies; the length is checked against `max_length` and the bytes left
  // first.
  template <typename What>
  std::string_view read_string(const What& what, uint64_t max_length = std::numeric_limits<uint64_t>::max()) {
    const uint64_t length = read<uint64_t>([&] { return "the length of " + name_of(what); });
    if (length > max_length) {
      fail(name_of(what) + " is " + std::to_string(length) + " bytes long; GGUF allows at most " + std::to_string(max_length) +
           " (the file is corrupt)");
    }
    if (length > left()) {
      fail(name_of(what) + " is " + std::to_string(length) + " bytes long, but only " + std::to_string(left()) +
           " bytes of the file are left; the file is corrupt or cut short");
    }
    const std::string_view s(reinterpret_cast<const char*>(p_ + at_), static_cast<size_t>(length));
    at_ += length;
    return s;
  }

  GgufType read_type(const std::string& what) {
    const uint32_t id = read<uint32_t>([&] { return "the type of " + what; });
    if (!valid_type(id)) {
      fail(what + " has value type " + std::to_string(id) + ", which GGUF does not define (0 to 12); the file is " +
           "corrupt or from a newer GGUF version");
    }
    return static_cast<GgufType>(id);
  }

  GgufValue read_value(GgufType type, const std::string& what, int depth) {
    GgufValue out;
    out.type_ = type;
    if (type == GgufType::String) {
      out.payload_ = std::string(read_string(what));
      return out;
    }
    if (type != GgufType::Array) {
      const size_t size = fixed_size(type);
      need(size, what);
      std::memcpy(&out.bits_, p_ + at_, size);
      if (type == GgufType::Bool && out.bits_ > 1)
        fail(what + " is a bool holding " + std::to_string(out.bits_) + "; GGUF bools are 0 or 1 (the file is corrupt)");
      at_ += size;
      return out;
    }
    if (depth >= kMaxNesting)
      fail(what + " nests arrays more than " + std::to_string(kMaxNesting) + " deep; the file is corrupt");
    out.element_ = read_type("the elements of " + what);
    const uint64_t count = read<uint64_t>([&] { return "the length of " + what; });
    // Each element takes at least this many bytes, so the count is bounded by what is left of the file.
    // (a string: its u64 length; an array: its u32 element type and u64 length).
    const uint64_t element_bytes = out.element_ == GgufType::String  ? 8
                                   : out.element_ == GgufType::Array ? 12
                                                                     : fixed_size(out.element_);
    if (count > left() / element_bytes) {
      fail(what + " is an array of " + std::to_string(count) + " " + gguf_type_name(out.element_) +
           " elements, but the " + std::to_string(left()) + " bytes left in the file hold at most " +
           std::to_string(left() / element_bytes) + "; the file is corrupt or cut short");
    }
    if (out.element_ == GgufType::String) {  // each length checked against the bytes left, the strings left in place
      const uint64_t start = at_;
      for (uint64_t i = 0; i < count; ++i) read_string([&] { return what + "[" + std::to_string(i) + "]"; });
      out.payload_ = GgufValue::Packed{owner_, {p_ + start, static_cast<size_t>(at_ - start)}, count};
    } else if (out.element_ == GgufType::Array) {
      std::vector<GgufValue> items;
      // Each element is an array without a type of its own: its element type, length and elements.
      for (uint64_t i = 0; i < count; ++i)
        items.push_back(read_value(GgufType::Array, what + "[" + std::to_string(i) + "]", depth + 1));
      out.payload_ = std::move(items);
    } else {
      const uint64_t bytes = count * element_bytes;  // ≤ left(): no overflow
      const std::span<const std::byte> packed(p_ + at_, static_cast<size_t>(bytes));
      if (out.element_ == GgufType::Bool) {
        for (uint64_t i = 0; i < count; ++i)
          if (std::to_integer<uint8_t>(packed[i]) > 1)
            fail(what + "[" + std::to_string(i) + "] is a bool holding " +
                 std::to_string(std::to_integer<int>(packed[i])) + "; GGUF bools are 0 or 1 (the file is corrupt)");
      }
      at_ += bytes;
      out.payload_ = GgufValue::Packed{owner_, packed, count};
    }
    return out;
  }

 private:
  std::shared_ptr<const void> owner_;
  const std::byte* p_;
  uint64_t size_;
  uint64_t at_ = 0;
  const std::string& label_;
};

GgufFile GgufFile::open(const std::string& path, MapAccess access) {
  GgufFile file;
  file.label_ = path;
  file.mapped_ = std::make_shared<MappedFile>(MappedFile::open(path, access));
  file.validate(file.mapped_, file.mapped_->data(), file.mapped_->size());
  return file;
}

GgufFile GgufFile::parse(std::vector<std::byte> bytes, const std::string& label) {
  GgufFile file;
  file.label_ = label;
  file.owned_ = std::make_shared<std::vector<std::byte>>(std::move(bytes));
  file.validate(file.owned_, file.owned_->data(), file.owned_->size());
  return file;
}

void GgufFile::validate(std::shared_ptr<const void> owner, const std::byte* bytes, size_t size) {
  GgufReader r(std::move(owner), bytes, size, label_);
  size_ = size;

  // Header: magic, version, counts.
  if (size < 4 || std::memcmp(bytes, "GGUF", 4) != 0) {
    std::string start(reinterpret_cast<const char*>(bytes), std::min<size_t>(size, 4));
    r.fail("not a GGUF file: it starts with '" + printable(start) + "', a GGUF file with 'GGUF'" +
           (size < 4 ? " (the file is only " + count_text(size, "byte", "bytes") + ")" : ""));
  }
  r.read<uint32_t>("the magic");
  version_ = r.read<uint32_t>("the version");
  if (version_ == 1) {
    r.fail("GGUF version 1 (2023's first format, with 32-bit counts) is no longer read by qkv or llama.cpp; "
           "convert the model again with a current llama.cpp");
  }
  if (version_ != 2 && version_ != 3) {
    const uint32_t swapped = __builtin_bswap32(version_);
    if (swapped >= 1 && swapped <= 3) {
      r.fail("a big-endian GGUF file (its version reads " + std::to_string(version_) + ", version " +
             std::to_string(swapped) + " byte-swapped); qkv reads little-endian GGUF only: convert it with a " +
             "little-endian llama.cpp (gguf-py's gguf_convert_endian.py)");
    }
    r.fail("GGUF version " + std::to_string(version_) + " is not one qkv reads (2 and 3 are)" +
           (version_ > 3 ? "; the file may come from a newer llama.cpp" : "; the file is corrupt"));
  }
  const uint64_t tensor_count = r.read<uint64_t>("the tensor count");
  const uint64_t metadata_count = r.read<uint64_t>("the metadata count");
  if (metadata_count > r.left() / kMinMetadataBytes) {
    r.fail("the header counts " + count_text(metadata_count, "metadata entry", "metadata entries") + ", but the " +
           std::to_string(r.left()) + " bytes after it hold at most " + std::to_string(r.left() / kMinMetadataBytes) +
           "; the file is corrupt or cut short");
  }
  if (tensor_count > r.left() / kMinTensorBytes) {
    r.fail("the header counts " + count_text(tensor_count, "tensor", "tensors") + ", but the " + std::to_string(r.left()) +
           " bytes after it hold at most " + std::to_string(r.left() / kMinTensorBytes) +
           "; the file is corrupt or cut short");
  }

  // Metadata.
  // Reserved up to a bound only: an entry takes ~100 bytes here and 14 in the file, so a count merely checked
  // against the bytes left (tensor data included) could still ask for several times the file.
  constexpr uint64_t kReserveAtMost = 4096;
  metadata_.reserve(static_cast<size_t>(std::min(metadata_count, kReserveAtMost)));
  for (uint64_t i = 0; i < metadata_count; ++i) {
    std::string key(r.read_string("metadata key #" + std::to_string(i), kMaxKeyLength));
    if (key.empty()) r.fail("metadata key #" + std::to_string(i) + " is empty; the file is corrupt");
    if (key_index_.count(key)) r.fail("metadata key '" + printable(key) + "' appears twice; the file is corrupt");
    const std::string what = "metadata '" + printable(key) + "'";
    const GgufType type = r.read_type(what);
    GgufValue value = r.read_value(type, what, 0);
    key_index_.emplace(key, metadata_.size());
    metadata_.emplace_back(std::move(key), std::move(value));
  }
  if (const GgufValue* a = find_value("general.alignment")) {
    if (a->type() != GgufType::U32)
      r.fail("general.alignment is " + a->type_text() + "; it must be a u32 (ggml reads only that)");
    const uint64_t alignment = a->as_uint64();
    if (alignment == 0 || !std::has_single_bit(alignment))
      r.fail("general.alignment is " + std::to_string(alignment) + "; it must be a power of two (32 by default)");
    alignment_ = static_cast<uint32_t>(alignment);
  }

  // The tensor table.
  tensors_.reserve(static_cast<size_t>(std::min(tensor_count, kReserveAtMost)));
  for (uint64_t i = 0; i < tensor_count; ++i) {
    GgufTensor t;
    t.name = std::string(r.read_string("the name of tensor #" + std::to_string(i), kMaxNameLength));
    if (t.name.empty()) r.fail("tensor #" + std::to_string(i) + " has an empty name; the file is corrupt");
    const std::string what = "tensor '" + printable(t.name) + "'";
    if (tensor_index_.count(t.name)) r.fail(what + " appears twice in the tensor table; the file is corrupt");
    const uint32_t n_dims = r.read<uint32_t>("the number of dims of " + what);
    if (n_dims > kMaxDims) {
      r.fail(what + " has " + std::to_string(n_dims) + " dims; GGUF (ggml) allows at most " +
             std::to_string(kMaxDims));
    }
    int64_t numel = 1;
    bool overflow = false;
    for (uint32_t d = 0; d < n_dims; ++d) {
      const uint64_t dim = r.read<uint64_t>("dim " + std::to_string(d) + " of " + what);
      if (dim > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        r.fail("dim " + std::to_string(d) + " of " + what + " is " + std::to_string(dim) +
               ", negative as ggml's int64; the file is corrupt");
      }
      t.dims.push_back(static_cast<int64_t>(dim));
      overflow = overflow || __builtin_mul_overflow(numel, static_cast<int64_t>(dim), &numel);
    }
    auto dims_text = [&] {
      std::string s = "[";
      for (size_t d = 0; d < t.dims.size(); ++d) s += (d ? ", " : "") + std::to_string(t.dims[d]);
      return s + "]";
    };
    if (overflow) r.fail(what + " has dims " + dims_text() + ", more than 2^63 elements; the file is corrupt");
    const uint32_t type_id = r.read<uint32_t>("the type of " + what);
    const GgmlTypeInfo* info = ggml_type_info(type_id);
    if (!info) {
      if (const char* removed = removed_type_name(type_id)) {
        r.fail(what + " has ggml type " + std::to_string(type_id) + " (" + removed + "), which ggml removed; " +
               "convert or quantize the model again with a current llama.cpp");
      }
      r.fail(what + ": ggml type " + std::to_string(type_id) + " is unknown (qkv knows ggml's types up to " +
             std::to_string(static_cast<uint32_t>(kGgmlTypes[std::size(kGgmlTypes) - 1].type)) +
             "); the file is corrupt or from a newer llama.cpp");
    }
    t.type = info->type;
    const int64_t ne0 = t.dims.empty() ? 1 : t.dims[0];
    if (ne0 % info->block_size != 0) {
      r.fail(what + " is " + info->name + ", stored in blocks of " + std::to_string(info->block_size) +
             " elements, but its rows (ne0) hold " + std::to_string(ne0) + ", not a multiple; the file is corrupt");
    }
    const uint64_t blocks = static_cast<uint64_t>(numel) / static_cast<uint64_t>(info->block_size);
    if (blocks > std::numeric_limits<uint64_t>::max() / static_cast<uint64_t>(info->block_bytes))
      r.fail(what + " has dims " + dims_text() + ", more bytes than 2^64; the file is corrupt");
    t.bytes = blocks * static_cast<uint64_t>(info->block_bytes);
    t.offset = r.read<uint64_t>("the offset of " + what);
    if (t.offset % alignment_ != 0) {
      r.fail(what + " starts at offset " + std::to_string(t.offset) + " of the data section, not a multiple of " +
             "the alignment " + std::to_string(alignment_) + "; the file is corrupt");
    }
    tensor_index_.emplace(t.name, tensors_.size());
    tensors_.push_back(std::move(t));
  }

  // The data section starts at the next multiple of the alignment; every tensor lies inside it, none overlapping.
  data_offset_ = align_up(r.at(), alignment_);  // r.at() ≤ size < 2^63: no overflow
  if (!tensors_.empty() && data_offset_ > size) {
    r.fail("truncated: the data section would start at offset " + std::to_string(data_offset_) +
           ", past the end of the file (" + std::to_string(size) + " bytes); the file is cut short");
  }
  const uint64_t data_size = data_offset_ <= size ? size - data_offset_ : 0;
  for (GgufTensor& t : tensors_) {
    if (t.offset > data_size || t.bytes > data_size - t.offset) {
      r.fail("tensor '" + printable(t.name) + "' (" + ggml_type_name(t.type) + ", " + std::to_string(t.bytes) +
             " bytes at offset " + std::to_string(t.offset) + " of the data section) runs past the end of the file: " +
             "the data section holds " + std::to_string(data_size) + " bytes; the file is truncated or corrupt");
    }
    t.data = t.bytes ? bytes + data_offset_ + t.offset : nullptr;
  }
  std::vector<size_t> order(tensors_.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return tensors_[a].offset < tensors_[b].offset; });
  const GgufTensor* previous = nullptr;  // the non-empty tensor ending last so far
  for (size_t i : order) {
    const GgufTensor& t = tensors_[i];
    if (t.bytes == 0) continue;  // owns no bytes
    if (previous && t.offset < previous->offset + previous->bytes) {
      r.fail("tensors '" + printable(previous->name) + "' (bytes " + std::to_string(previous->offset) + " to " +
             std::to_string(previous->offset + previous->bytes) + ") and '" + printable(t.name) + "' (from " +
             std::to_string(t.offset) + ") overlap in the data section; the file is corrupt");
    }
    if (!previous || t.offset + t.bytes > previous->offset + previous->bytes) previous = &t;
  }
}

const GgufValue* GgufFile::find_value(std::string_view key) const {
  const auto it = key_index_.find(key);
  return it == key_index_.end() ? nullptr : &metadata_[it->second].second;
}

const GgufValue& GgufFile::value(std::string_view key) const {
  const GgufValue* v = find_value(key);
  if (!v) throw IoError(label_ + ": has no metadata key '" + printable(key) + "'");
  return *v;
}

namespace {
[[noreturn]] void wrong_type(const std::string& label, std::string_view key, const GgufValue& v, const char* expected) {
  throw IoError(label + ": metadata '" + printable(key) + "' is " + v.type_text() + ", expected " + expected);
}
}  // namespace

std::string GgufFile::string(std::string_view key) const {
  const GgufValue& v = value(key);
  if (v.type() != GgufType::String) wrong_type(label_, key, v, "a string");
  return v.as_string();
}

int64_t GgufFile::integer(std::string_view key) const {
  const GgufValue& v = value(key);
  if (!v.is_integer()) wrong_type(label_, key, v, "an integer");
  try {
    return v.as_int64();
  } catch (const ValueError& e) {
    throw IoError(label_ + ": metadata '" + printable(key) + "': " + e.what());
  }
}

double GgufFile::real(std::string_view key) const {
  const GgufValue& v = value(key);
  if (!v.is_float()) wrong_type(label_, key, v, "a float (f32 or f64)");
  return v.as_double();
}

bool GgufFile::boolean(std::string_view key) const {
  const GgufValue& v = value(key);
  if (v.type() != GgufType::Bool) wrong_type(label_, key, v, "a bool");
  return v.as_bool();
}

std::vector<std::string> GgufFile::strings(std::string_view key) const { return string_list(key).to_vector(); }

GgufStrings GgufFile::string_list(std::string_view key) const {
  const GgufValue& v = value(key);
  if (!v.is_array() || v.element_type() != GgufType::String) wrong_type(label_, key, v, "an array of str");
  return v.string_list();
}

std::vector<int64_t> GgufFile::integers(std::string_view key) const {
  const GgufValue& v = value(key);
  if (!v.is_array() || !integer_type(v.element_type())) wrong_type(label_, key, v, "an array of integers");
  try {
    return v.as_int64s();
  } catch (const ValueError& e) {
    throw IoError(label_ + ": metadata '" + printable(key) + "': " + e.what());
  }
}

std::vector<float> GgufFile::floats(std::string_view key) const {
  const GgufValue& v = value(key);
  if (!v.is_array() || (v.element_type() != GgufType::F32 && v.element_type() != GgufType::F64))
    wrong_type(label_, key, v, "an array of f32 or f64");
  return v.as_floats();
}

const GgufTensor* GgufFile::find(std::string_view name) const {
  const auto it = tensor_index_.find(name);
  return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}

const GgufTensor& GgufFile::tensor(std::string_view name) const {
  const GgufTensor* t = find(name);
  if (!t) throw IoError(label_ + ": has no tensor '" + printable(name) + "'");
  return *t;
}

void GgufFile::require_types(std::span<const GgmlType> supported) const {
  for (const GgufTensor& t : tensors_) {
    if (std::find(supported.begin(), supported.end(), t.type) != supported.end()) continue;
    std::string names;
    for (GgmlType s : supported) names += (names.empty() ? "" : ", ") + ggml_type_name(s);
    throw IoError(label_ + ": tensor '" + printable(t.name) + "' is " + ggml_type_name(t.type) +
                  ", which qkv cannot compute with; it reads " + names +
                  ": quantize the original model to one of those (qkv quantize, or llama.cpp's llama-quantize)");
  }
}

std::vector<int64_t> GgufTensor::shape() const { return {dims.rbegin(), dims.rend()}; }

int64_t GgufTensor::numel() const {
  int64_t n = 1;
  for (int64_t d : dims) n *= d;  // checked not to overflow when the file was read
  return n;
}

// ---------------------------------------------------------------------------------------------------------------
// Writing

namespace {

template <typename T>
void put(std::vector<std::byte>& out, T v) {
  const auto* p = reinterpret_cast<const std::byte*>(&v);
  out.insert(out.end(), p, p + sizeof v);
}

void put_string(std::vector<std::byte>& out, std::string_view s) {
  put<uint64_t>(out, s.size());
  const auto* p = reinterpret_cast<const std::byte*>(s.data());
  out.insert(out.end(), p, p + s.size());
}

// A value's bytes after its type (a scalar, a string, or an array's element type, length and elements).
void put_value(std::vector<std::byte>& out, const GgufValue& v) {
  if (v.type() == GgufType::String) return put_string(out, v.as_string());
  if (!v.is_array()) {  // the low bytes of the stored bits, as they were read or made
    const uint64_t bits = v.scalar_bits();
    const auto* p = reinterpret_cast<const std::byte*>(&bits);
    out.insert(out.end(), p, p + fixed_size(v.type()));
    return;
  }
  put<uint32_t>(out, static_cast<uint32_t>(v.element_type()));
  put<uint64_t>(out, v.size());
  if (v.element_type() == GgufType::String) {
    for (std::string_view s : v.string_list()) put_string(out, s);
  } else if (v.element_type() == GgufType::Array) {
    for (const GgufValue& item : v.as_arrays()) put_value(out, item);  // no type: an array is implied
  } else {
    const auto raw = v.raw();
    out.insert(out.end(), raw.begin(), raw.end());
  }
}

[[noreturn]] void writer_error(const std::string& path, const std::string& problem) {
  throw ValueError(path + ": cannot write this GGUF file: " + problem);
}

}  // namespace

GgufWriter::GgufWriter(std::string path) : path_(std::move(path)), out_(path_) {}

void GgufWriter::add_metadata(std::string key, GgufValue value) {
  if (header_written_) writer_error(path_, "metadata '" + printable(key) + "' added after the tensor data began");
  if (key.empty()) writer_error(path_, "a metadata key is empty");
  if (key.size() > kMaxKeyLength) writer_error(path_, "metadata key '" + printable(key) + "' is over 65535 bytes");
  if (keys_.count(key)) writer_error(path_, "metadata key '" + printable(key) + "' is given twice");
  if (key == "general.alignment") {
    if (value.type() != GgufType::U32) writer_error(path_, "general.alignment must be a u32, not " + value.type_text());
    const uint64_t alignment = value.as_uint64();
    if (alignment == 0 || !std::has_single_bit(alignment))
      writer_error(path_, "general.alignment " + std::to_string(alignment) + " is not a power of two");
    if (!tensors_.empty()) writer_error(path_, "general.alignment is set after tensors were declared");
    alignment_ = static_cast<uint32_t>(alignment);
  }
  keys_.insert(key);
  metadata_.emplace_back(std::move(key), std::move(value));
}

uint64_t GgufWriter::add_tensor(std::string name, std::vector<int64_t> dims, GgmlType type) {
  if (header_written_) writer_error(path_, "tensor '" + printable(name) + "' declared after the tensor data began");
  if (name.empty()) writer_error(path_, "a tensor name is empty");
  // ggml keeps names in 64-byte buffers with a terminating zero: a longer name would not load in llama.cpp.
  if (name.size() >= kMaxNameLength)
    writer_error(path_, "tensor name '" + printable(name) + "' is " + std::to_string(name.size()) +
                            " bytes; llama.cpp reads at most 63");
  if (names_.count(name)) writer_error(path_, "two tensors are named '" + printable(name) + "'");
  if (dims.size() > static_cast<size_t>(kMaxDims))
    writer_error(path_, "tensor '" + printable(name) + "' has " + std::to_string(dims.size()) + " dims; GGUF allows 4");
  const GgmlTypeInfo* info = ggml_type_info(static_cast<uint32_t>(type));
  if (!info) writer_error(path_, "tensor '" + printable(name) + "' has " + ggml_type_name(static_cast<uint32_t>(type)));
  int64_t numel = 1;
  for (int64_t d : dims) {
    if (d < 0) writer_error(path_, "tensor '" + printable(name) + "' has a negative dim");
    if (__builtin_mul_overflow(numel, d, &numel)) writer_error(path_, "tensor '" + printable(name) + "' is too large");
  }
  const int64_t ne0 = dims.empty() ? 1 : dims[0];
  if (ne0 % info->block_size != 0) {
    writer_error(path_, "tensor '" + printable(name) + "' is " + info->name + " (blocks of " +
                            std::to_string(info->block_size) + ") but its rows (ne0) hold " + std::to_string(ne0));
  }
  const uint64_t bytes = ggml_bytes(type, static_cast<uint64_t>(numel));
  names_.insert(name);
  tensors_.push_back({std::move(name), std::move(dims), type, bytes, data_size_});
  data_size_ += align_up(bytes, alignment_);
  return bytes;
}

void GgufWriter::write_header() {
  std::vector<std::byte> header;
  header.insert(header.end(), {std::byte{'G'}, std::byte{'G'}, std::byte{'U'}, std::byte{'F'}});
  put<uint32_t>(header, 3);
  put<uint64_t>(header, tensors_.size());
  put<uint64_t>(header, metadata_.size());
  for (const auto& [key, value] : metadata_) {
    put_string(header, key);
    put<uint32_t>(header, static_cast<uint32_t>(value.type()));
    put_value(header, value);
  }
  for (const Entry& e : tensors_) {
    put_string(header, e.name);
    put<uint32_t>(header, static_cast<uint32_t>(e.dims.size()));
    for (int64_t d : e.dims) put<uint64_t>(header, static_cast<uint64_t>(d));
    put<uint32_t>(header, static_cast<uint32_t>(e.type));
    put<uint64_t>(header, e.offset);
  }
  header.resize(align_up(header.size(), alignment_));  // zero padding up to the data section
  out_.write(header);
  header_written_ = true;
}

void GgufWriter::write_tensor_data(std::span<const std::byte> bytes) {
  if (!header_written_) write_header();
  while (true) {
    // Tensors whose bytes are complete (or that have none) are padded and passed.
    while (current_ < tensors_.size() && current_written_ == tensors_[current_].bytes) {
      out_.write_zeros(align_up(tensors_[current_].bytes, alignment_) - tensors_[current_].bytes);
      ++current_;
      current_written_ = 0;
    }
    if (bytes.empty()) return;
    if (current_ == tensors_.size())
      writer_error(path_, std::to_string(bytes.size()) + " bytes more than the declared tensors hold");
    const uint64_t take = std::min<uint64_t>(bytes.size(), tensors_[current_].bytes - current_written_);
    out_.write(bytes.first(static_cast<size_t>(take)));
    current_written_ += take;
    bytes = bytes.subspan(static_cast<size_t>(take));
  }
}

void GgufWriter::finish() {
  write_tensor_data({});
  if (current_ < tensors_.size()) {
    writer_error(path_, "tensor '" + printable(tensors_[current_].name) + "' got " + std::to_string(current_written_) +
                            " of its " + std::to_string(tensors_[current_].bytes) + " bytes");
  }
  out_.commit();
}

void save_gguf(const std::string& path, const std::vector<std::pair<std::string, GgufValue>>& metadata,
               const std::vector<GgufTensorData>& tensors) {
  GgufWriter writer(path);
  for (const auto& [key, value] : metadata) writer.add_metadata(key, value);
  for (const GgufTensorData& t : tensors) {
    const uint64_t bytes = writer.add_tensor(t.name, t.dims, t.type);
    if (bytes != t.bytes.size()) {
      writer_error(path, "tensor '" + printable(t.name) + "' is given " + std::to_string(t.bytes.size()) +
                             " bytes; its dims and type take " + std::to_string(bytes));
    }
  }
  for (const GgufTensorData& t : tensors) writer.write_tensor_data(t.bytes);
  writer.finish();
}

}  // namespace qkv::io
