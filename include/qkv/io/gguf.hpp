// GGUF, the file format of ggml and llama.cpp: read (memory-mapped, every count, length, shape and offset checked
// against the file before anything is allocated) and written (version 3, aligned, streamed, atomically).
// Format (ggml's docs/gguf.md): "GGUF", u32 version, u64 tensor count, u64 metadata count, the metadata (key,
// typed value), the tensor table (name, dims with ne0 the fastest-varying, ggml type id, offset), padding to the
// alignment, the tensor data. Not here: what the tensors and keys mean (the model side), block formats'
// arithmetic (kernels); this layer only knows each ggml type's block size and bytes per block, to check sizes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <iterator>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <variant>
#include <vector>

#include "qkv/io/file.hpp"

namespace qkv::io {

// ggml's tensor element types, numbered as in ggml.h (the ids stored in GGUF files). Ids 4, 5, 31–33 and 36–38
// were removed from ggml and have no layout; any other id not listed is unknown.
enum class GgmlType : uint32_t {
  F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q8_1 = 9,
  Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14, Q8_K = 15,
  IQ2_XXS = 16, IQ2_XS = 17, IQ3_XXS = 18, IQ1_S = 19, IQ4_NL = 20, IQ3_S = 21, IQ2_S = 22, IQ4_XS = 23,
  I8 = 24, I16 = 25, I32 = 26, I64 = 27, F64 = 28, IQ1_M = 29, BF16 = 30,
  TQ1_0 = 34, TQ2_0 = 35, MXFP4 = 39, NVFP4 = 40, Q1_0 = 41, Q2_0 = 42,
};

// One row of the table of ggml types: a tensor of this type is stored in blocks of `block_size` elements along
// ne0, each `block_bytes` bytes (F32: 1 element in 4 bytes; Q8_0: 32 in 34; Q4_K: 256 in 144).
struct GgmlTypeInfo {
  GgmlType type;  // its id
  const char* name;  // as llama.cpp prints it: "F32", "Q4_K", "IQ2_XXS"
  int64_t block_size;  // elements per block
  int64_t block_bytes;  // bytes per block
};
// The row for `id`, or nullptr if ggml has no such type (unknown or removed).
const GgmlTypeInfo* ggml_type_info(uint32_t id);
// Every known type, in id order.
std::span<const GgmlTypeInfo> ggml_types();
// "Q4_K"; "removed type Q4_0_4_4" for an id ggml removed; "ggml type 99 (unknown)" otherwise.
std::string ggml_type_name(uint32_t id);
inline std::string ggml_type_name(GgmlType type) { return ggml_type_name(static_cast<uint32_t>(type)); }
// The bytes of `elements` elements of a known type (elements a multiple of its block size); no overflow check.
uint64_t ggml_bytes(GgmlType type, uint64_t elements);

// The types of metadata values, numbered as in the file.
enum class GgufType : uint32_t {
  U8 = 0, I8 = 1, U16 = 2, I16 = 3, U32 = 4, I32 = 5, F32 = 6, Bool = 7, String = 8, Array = 9,
  U64 = 10, I64 = 11, F64 = 12,
};
const char* gguf_type_name(GgufType type);  // "u32", "str", "arr" (ggml's names), "type 13" if unknown

// An array of str as a GGUF file lays it out (each element a u64 length and its bytes), read in place: iterating
// yields each string as a string_view into those bytes, valid while the GgufValue it came from (and so the file or
// bytes it was read from) lives. A tokenizer's 150,000 tokens are read without a copy or an allocation each.
class GgufStrings {
 public:
  // A forward iterator over the strings, in file order
  class iterator {
   public:
    using iterator_category = std::forward_iterator_tag;  // one pass, forward
    using value_type = std::string_view;                  // each string, in place
    using difference_type = std::ptrdiff_t;               // a distance between two positions
    using pointer = const std::string_view*;              // unused: operator* returns a value
    using reference = std::string_view;                   // operator*'s type: a view, not a reference
    iterator() = default;                                 // a singular iterator
    explicit iterator(const std::byte* at) : at_(at) {}  // at the length of a string
    // The string here
    std::string_view operator*() const {
      uint64_t length;
      std::memcpy(&length, at_, sizeof length);
      return {reinterpret_cast<const char*>(at_ + sizeof length), static_cast<size_t>(length)};
    }
    // On to the next string
    iterator& operator++() {
      uint64_t length;
      std::memcpy(&length, at_, sizeof length);
      at_ += sizeof length + length;
      return *this;
    }
    // On to the next string, returning where it was
    iterator operator++(int) {
      iterator before = *this;
      ++*this;
      return before;
    }
    bool operator==(const iterator& other) const { return at_ == other.at_; }  // at the same string

   private:
    const std::byte* at_ = nullptr;
  };
  GgufStrings() = default;
  // `bytes` holds `count` strings laid out as above (checked by whoever made it: the reader, the factory).
  GgufStrings(std::span<const std::byte> bytes, uint64_t count) : bytes_(bytes), count_(count) {}
  uint64_t size() const { return count_; }  // how many strings
  bool empty() const { return count_ == 0; }  // no strings
  iterator begin() const { return iterator(bytes_.data()); }  // the first string
  iterator end() const { return iterator(bytes_.data() + bytes_.size()); }  // past the last
  std::vector<std::string> to_vector() const { return {begin(), end()}; }  // a copy of each

 private:
  std::span<const std::byte> bytes_;
  uint64_t count_ = 0;
};

// One metadata value: a number, a bool, a string, or an array of one element type (an array of arrays holds arrays
// whose element types may differ). Made with the named factories, so the stored type is explicit (general.alignment
// must be u32, not i32 or u64). An array of numbers or strings read from a file stays in the file's bytes (shared
// with the GgufFile: a value copied out keeps its file's mapping alive); one made here holds bytes of its own.
class GgufValue {
 public:
  GgufValue() = default;  // a u8 0
  static GgufValue u8(uint8_t v);  // a u8 (type 0)
  static GgufValue i8(int8_t v);  // an i8 (type 1)
  static GgufValue u16(uint16_t v);  // a u16 (type 2)
  static GgufValue i16(int16_t v);  // an i16 (type 3)
  static GgufValue u32(uint32_t v);  // a u32 (type 4)
  static GgufValue i32(int32_t v);  // an i32 (type 5)
  static GgufValue f32(float v);  // an f32 (type 6)
  static GgufValue boolean(bool v);  // a bool (type 7, one byte: 0 or 1)
  static GgufValue string(std::string v);  // a str (type 8: u64 length, UTF-8 bytes)
  static GgufValue u64(uint64_t v);  // a u64 (type 10)
  static GgufValue i64(int64_t v);  // an i64 (type 11)
  static GgufValue f64(double v);  // an f64 (type 12)
  // Arrays of numbers, bools, strings; arrays of arrays (each element an array).
  static GgufValue u8s(std::span<const uint8_t> v);
  static GgufValue i8s(std::span<const int8_t> v);
  static GgufValue u16s(std::span<const uint16_t> v);
  static GgufValue i16s(std::span<const int16_t> v);
  static GgufValue u32s(std::span<const uint32_t> v);
  static GgufValue i32s(std::span<const int32_t> v);
  static GgufValue f32s(std::span<const float> v);
  static GgufValue booleans(const std::vector<bool>& v);
  static GgufValue strings(std::vector<std::string> v);
  static GgufValue u64s(std::span<const uint64_t> v);
  static GgufValue i64s(std::span<const int64_t> v);
  static GgufValue f64s(std::span<const double> v);
  static GgufValue arrays(std::vector<GgufValue> v);  // ValueError if an element is not an array
  // An empty array of `element` type.
  static GgufValue empty_array(GgufType element);

  GgufType type() const { return type_; }  // String, Array, or a number's / bool's type
  bool is_array() const { return type_ == GgufType::Array; }  // an arr
  bool is_integer() const;  // any of u8 … i64 (not bool)
  bool is_float() const { return type_ == GgufType::F32 || type_ == GgufType::F64; }  // f32 or f64
  GgufType element_type() const { return element_; }  // an array's element type
  uint64_t size() const;  // an array's length (1 for a scalar)
  std::string type_text() const;  // "u32", "str", "array of str", "array of array"

  // A scalar's value; ValueError naming both types if it is another type. as_int64 takes any integer type
  // (a u64 above 2^63 - 1 is refused); as_double f32 or f64.
  int64_t as_int64() const;
  uint64_t as_uint64() const;  // any integer type, negative refused
  double as_double() const;
  bool as_bool() const;
  const std::string& as_string() const;
  // An array's elements: integers from any integer element type, floats from f32 or f64, strings, arrays.
  std::vector<int64_t> as_int64s() const;
  std::vector<float> as_floats() const;
  std::vector<double> as_doubles() const;
  std::vector<std::string> as_strings() const;  // a copy of each
  GgufStrings string_list() const;  // the same, in place
  const std::vector<GgufValue>& as_arrays() const;
  // A fixed-size-element array's elements as stored (little-endian, packed); empty for strings and arrays.
  std::span<const std::byte> raw() const;
  // A scalar number's or bool's bits as stored (little-endian, zero above its width): what is written back.
  uint64_t scalar_bits() const { return bits_; }

  // The same type and the same value, bit for bit (NaN payloads included).
  bool operator==(const GgufValue& other) const;

 private:
  friend class GgufReader;
  template <typename T>
  static GgufValue scalar(GgufType type, T v);
  template <typename T>
  static GgufValue packed(GgufType element, std::span<const T> v);
  // An array of numbers or strings as the file lays out its elements (GgufStrings' layout for strings), kept alive
  // by `owner`: the file's mapping or bytes, or the factory's own.
  struct Packed {
    std::shared_ptr<const void> owner;
    std::span<const std::byte> bytes;
    uint64_t count = 0;
    bool operator==(const Packed& other) const;
  };
  static Packed own(std::vector<std::byte> bytes, uint64_t count);
  GgufType type_ = GgufType::U8;
  GgufType element_ = GgufType::U8;  // arrays only
  uint64_t bits_ = 0;  // a scalar number's or bool's little-endian bits
  // a string; an array of numbers, bools or strings; an array of arrays
  std::variant<std::monostate, std::string, Packed, std::vector<GgufValue>> payload_;
};

// One entry of a GGUF file's tensor table.
struct GgufTensor {
  std::string name;  // "blk.0.attn_q.weight"
  std::vector<int64_t> dims;  // ggml order: dims[0] is ne0, the fastest-varying (the row length)
  GgmlType type = GgmlType::F32;  // how its elements are stored
  uint64_t offset = 0;  // from the start of the data section (a multiple of the alignment)
  uint64_t bytes = 0;  // its size in the file
  const std::byte* data = nullptr;  // its first byte, in the mapped file (nullptr for an empty tensor)

  std::vector<int64_t> shape() const;  // PyTorch order: dims reversed ((out, in) for a linear layer's weight)
  int64_t numel() const;  // elements: the product of dims
  std::span<const std::byte> span() const { return {data, static_cast<size_t>(bytes)}; }  // its bytes, in place
};

// A GGUF file, version 2 or 3, little-endian, mapped and validated. Tensor data are used in place (no copy): the
// tensors' `data` point into the mapping, valid while this object (or one it was moved into) lives.
// Refused with an IoError naming the file and the problem: a bad magic, version 1, 0 or > 3, a big-endian file, a
// count or length that the rest of the file cannot hold, an empty, over-long or duplicate key or tensor name, an
// unknown value type, a bool other than 0 or 1, arrays nested deeper than 64, general.alignment not a u32 power of
// two, more than 4 dims, a negative dim or dims whose product overflows, an unknown or removed ggml type, a row
// (ne0) not a multiple of the type's block, an offset not a multiple of the alignment, past the end of the file or
// overlapping another tensor, and a file cut short anywhere. Memory used for the metadata is at most a few times
// its bytes in the file; nothing is sized by a count before that count is checked against the bytes left.
class GgufFile {
 public:
  static constexpr uint32_t kDefaultAlignment = 32;  // without general.alignment
  // Maps `path` and validates it.
  static GgufFile open(const std::string& path, MapAccess access = MapAccess::Normal);
  // Validates bytes already in memory (kept alive by the returned object); `label` names it in errors.
  static GgufFile parse(std::vector<std::byte> bytes, const std::string& label = "<memory>");

  const std::string& path() const { return label_; }  // the path (or label) it was opened from
  uint32_t version() const { return version_; }  // 2 or 3
  uint32_t alignment() const { return alignment_; }  // general.alignment, or 32
  uint64_t data_offset() const { return data_offset_; }  // where the data section starts in the file
  uint64_t file_size() const { return size_; }  // bytes
  const MappedFile* mapping() const { return mapped_.get(); }  // the mapping (nullptr when parsed from memory)

  // Metadata, in file order.
  const std::vector<std::pair<std::string, GgufValue>>& metadata() const { return metadata_; }
  bool contains(std::string_view key) const { return find_value(key) != nullptr; }
  const GgufValue* find_value(std::string_view key) const;  // nullptr if absent
  // The value under `key`; IoError "has no metadata key 'k'" if absent.
  const GgufValue& value(std::string_view key) const;
  // Typed getters: IoError naming the file, the key, the type expected and the type found (or that it is absent).
  std::string string(std::string_view key) const;
  int64_t integer(std::string_view key) const;  // any integer width, signed or not (u64 above 2^63 - 1 refused)
  double real(std::string_view key) const;  // f32 or f64
  bool boolean(std::string_view key) const;
  std::vector<std::string> strings(std::string_view key) const;  // an array of str
  GgufStrings string_list(std::string_view key) const;  // the same in place (valid while this file lives)
  std::vector<int64_t> integers(std::string_view key) const;  // an array of any integer type
  std::vector<float> floats(std::string_view key) const;  // an array of f32 or f64

  // The tensor table, in file order.
  const std::vector<GgufTensor>& tensors() const { return tensors_; }
  const GgufTensor* find(std::string_view name) const;  // nullptr if absent
  // The named tensor; IoError "has no tensor 'x'" if absent.
  const GgufTensor& tensor(std::string_view name) const;
  // Refuses (IoError) the first tensor whose type is not in `supported`, naming the tensor, its type and the
  // supported ones: the check a consumer that computes with only some types makes before using the file.
  void require_types(std::span<const GgmlType> supported) const;

 private:
  friend class GgufReader;
  void validate(std::shared_ptr<const void> owner, const std::byte* bytes, size_t size);
  std::string label_;
  std::shared_ptr<MappedFile> mapped_;  // shared: moving a GgufFile keeps the tensors' pointers valid
  std::shared_ptr<std::vector<std::byte>> owned_;  // parse(): the bytes
  uint64_t size_ = 0;
  uint32_t version_ = 0;
  uint32_t alignment_ = kDefaultAlignment;
  uint64_t data_offset_ = 0;
  // Name → position, looked up with a string_view (no temporary string).
  struct NameHash {
    using is_transparent = void;
    size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
  };
  using Index = std::unordered_map<std::string, size_t, NameHash, std::equal_to<>>;
  std::vector<std::pair<std::string, GgufValue>> metadata_;
  Index key_index_;
  std::vector<GgufTensor> tensors_;
  Index tensor_index_;
};

// Writes a GGUF file (version 3) as it is made: metadata and the tensor table are declared first (the table holds
// every tensor's offset, so all shapes must be known), then each tensor's bytes follow in declaration order, in one
// or many pieces (a layer quantized at a time), so the file is never whole in memory. Each tensor starts on the
// alignment (general.alignment if set, else 32) and is padded to it, as ggml writes. The file appears at `path`
// only when finish() returns (AtomicFileWriter); abandoned, nothing is left behind.
// Mistakes are refused as they are made: ValueError for a duplicate or empty key or tensor name, a name over 63
// bytes (llama.cpp's limit), more than 4 dims, an unknown or removed type, ne0 not a multiple of its block, a
// general.alignment that is not a u32 power of two, bytes beyond or short of a tensor's size.
class GgufWriter {
 public:
  explicit GgufWriter(std::string path);  // creates path's temporary (AtomicFileWriter); IoError if it cannot
  void add_metadata(std::string key, GgufValue value);  // before the first tensor bytes
  // Declares a tensor: dims in ggml order (ne0 first). Returns its size in bytes.
  uint64_t add_tensor(std::string name, std::vector<int64_t> dims, GgmlType type);
  // Appends bytes of the tensors in declaration order (the first call writes the header). A piece may end inside
  // a tensor and the next continue it; a piece running past the last tensor is refused.
  void write_tensor_data(std::span<const std::byte> bytes);
  // Checks every tensor got all its bytes, pads, and moves the file into place; IoError / ValueError otherwise.
  void finish();

 private:
  void write_header();
  std::string path_;
  AtomicFileWriter out_;
  struct Entry {
    std::string name;
    std::vector<int64_t> dims;
    GgmlType type;
    uint64_t bytes, offset;
  };
  std::vector<std::pair<std::string, GgufValue>> metadata_;
  std::vector<Entry> tensors_;
  std::unordered_set<std::string> keys_, names_;  // to refuse duplicates
  uint32_t alignment_ = GgufFile::kDefaultAlignment;
  uint64_t data_size_ = 0;  // the padded size of the data section declared so far
  bool header_written_ = false;
  size_t current_ = 0;  // the tensor being written
  uint64_t current_written_ = 0;  // its bytes written so far
};

// One tensor for save_gguf: dims in ggml order, bytes as stored.
struct GgufTensorData {
  std::string name;  // ≤ 63 bytes
  std::vector<int64_t> dims;  // ggml order: ne0 first
  GgmlType type = GgmlType::F32;  // how `bytes` are stored
  std::span<const std::byte> bytes;  // exactly the size dims and type take (not owned)
};
// Writes a whole GGUF file in one call (GgufWriter underneath).
void save_gguf(const std::string& path, const std::vector<std::pair<std::string, GgufValue>>& metadata,
               const std::vector<GgufTensorData>& tensors);

}  // namespace qkv::io
