// .npy reading and writing. The header is a Python dict literal; we parse exactly the three keys
// NumPy writes ('descr', 'fortran_order', 'shape') and refuse anything else with a message.
#include "qkv/io/npy.hpp"

#include <cctype>
#include <cstring>
#include <fstream>
#include <limits>

#include "qkv/io/file.hpp"

namespace qkv::io {

namespace {

[[noreturn]] void fail(const std::string& label, const std::string& problem) { throw IoError(label + ": " + problem); }

// A tiny reader for the header dict: {'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }
class DictReader {
 public:
  DictReader(const std::string& text, const std::string& label) : s_(text), label_(label) {}

  void parse(std::string& descr, bool& fortran, std::vector<int64_t>& shape) {
    bool has_descr = false, has_fortran = false, has_shape = false;
    expect('{');
    while (true) {
      skip();
      if (peek() == '}') break;
      const std::string key = quoted();
      expect(':');
      if (key == "descr") {
        descr = quoted();
        has_descr = true;
      } else if (key == "fortran_order") {
        skip();
        if (s_.compare(pos_, 4, "True") == 0) {
          fortran = true;
          pos_ += 4;
        } else if (s_.compare(pos_, 5, "False") == 0) {
          fortran = false;
          pos_ += 5;
        } else {
          bad("fortran_order must be True or False");
        }
        has_fortran = true;
      } else if (key == "shape") {
        expect('(');
        while (true) {
          skip();
          if (peek() == ')') break;
          int64_t v = 0;
          if (!std::isdigit(static_cast<unsigned char>(peek()))) bad("shape must be a tuple of non-negative integers");
          while (std::isdigit(static_cast<unsigned char>(peek()))) {
            const int digit = s_[pos_++] - '0';
            if (v > (std::numeric_limits<int64_t>::max() - digit) / 10) bad("a shape dimension is too large");
            v = v * 10 + digit;
          }
          shape.push_back(v);
          skip();
          if (peek() == ',') ++pos_;
        }
        ++pos_;
        has_shape = true;
      } else {
        bad("unknown key '" + key + "'");
      }
      skip();
      if (peek() == ',') ++pos_;
    }
    if (!has_descr || !has_fortran || !has_shape) bad("the dict must have 'descr', 'fortran_order' and 'shape'");
  }

 private:
  [[noreturn]] void bad(const std::string& what) { fail(label_, "bad .npy header dict: " + what); }
  void skip() {
    while (pos_ < s_.size() && std::isspace(static_cast<unsigned char>(s_[pos_]))) ++pos_;
  }
  char peek() {
    if (pos_ >= s_.size()) bad("it ends early");
    return s_[pos_];
  }
  void expect(char c) {
    skip();
    if (peek() != c) bad(std::string("expected '") + c + "'");
    ++pos_;
  }
  std::string quoted() {
    skip();
    const char quote = peek();
    if (quote != '\'' && quote != '"') bad("expected a quoted string");
    ++pos_;
    const size_t end = s_.find(quote, pos_);
    if (end == std::string::npos) bad("unterminated string");
    std::string out = s_.substr(pos_, end - pos_);
    pos_ = end + 1;
    return out;
  }
  const std::string& s_;
  const std::string& label_;
  size_t pos_ = 0;
};

}  // namespace

Tensor parse_npy(const std::vector<std::byte>& bytes, const std::string& label) {
  static const unsigned char kMagic[] = {0x93, 'N', 'U', 'M', 'P', 'Y'};
  if (bytes.size() < 10 || std::memcmp(bytes.data(), kMagic, 6) != 0) {
    fail(label, "not a .npy file (bad magic; expected \\x93NUMPY)");
  }
  const auto major = static_cast<unsigned>(bytes[6]);
  size_t header_length = 0, header_start = 0;
  if (major == 1) {
    header_length = static_cast<size_t>(bytes[8]) | (static_cast<size_t>(bytes[9]) << 8);
    header_start = 10;
  } else if (major == 2 || major == 3) {
    if (bytes.size() < 12) fail(label, "truncated .npy header");
    uint32_t n;
    std::memcpy(&n, bytes.data() + 8, 4);
    header_length = n;
    header_start = 12;
  } else {
    fail(label, "unsupported .npy version " + std::to_string(major) + " (qkv reads versions 1, 2 and 3)");
  }
  if (header_length > bytes.size() - header_start) fail(label, "the .npy header runs past the end of the file (truncated)");
  const std::string header(reinterpret_cast<const char*>(bytes.data() + header_start), header_length);
  std::string descr;
  bool fortran = false;
  std::vector<int64_t> shape;
  DictReader(header, label).parse(descr, fortran, shape);
  if (fortran) {
    fail(label, "Fortran-order arrays are not supported; save with np.ascontiguousarray(a) or a C-order array");
  }
  size_t item = 0;
  if (descr == "<f4") item = 4;
  else if (descr == "<f8" || descr == "<i8") item = 8;
  else if (descr == "<i4") item = 4;
  else fail(label, "unsupported dtype '" + descr + "' (qkv reads '<f4', '<f8', '<i8' and '<i4')");
  if (shape.size() > static_cast<size_t>(kMaxRank)) {
    fail(label, "array has " + std::to_string(shape.size()) + " dimensions; qkv supports up to 4");
  }
  uint64_t count = 1;
  for (int64_t d : shape) {
    if (d != 0 && count > std::numeric_limits<uint64_t>::max() / static_cast<uint64_t>(d) / item) {
      fail(label, "shape's element count overflows");
    }
    count *= static_cast<uint64_t>(d);
  }
  const size_t data_start = header_start + header_length;
  const uint64_t available = bytes.size() - data_start;
  if (available != count * item) {
    fail(label, "data holds " + std::to_string(available) + " bytes but shape × dtype needs " +
                    std::to_string(count * item) + (available < count * item ? " (truncated)" : " (trailing bytes)"));
  }
  Tensor out = Tensor::empty(Shape(std::span<const int64_t>(shape)));
  const std::byte* p = bytes.data() + data_start;
  float* dst = out.data();
  for (uint64_t i = 0; i < count; ++i) {
    const std::byte* e = p + i * item;
    if (descr == "<f4") std::memcpy(&dst[i], e, 4);
    else if (descr == "<f8") { double v; std::memcpy(&v, e, 8); dst[i] = static_cast<float>(v); }
    else if (descr == "<i8") { int64_t v; std::memcpy(&v, e, 8); dst[i] = static_cast<float>(v); }
    else { int32_t v; std::memcpy(&v, e, 4); dst[i] = static_cast<float>(v); }
  }
  return out;
}

Tensor load_npy(const std::string& path) { return parse_npy(read_file(path), path); }

void save_npy(const std::string& path, const Tensor& t) {
  std::string dict = "{'descr': '<f4', 'fortran_order': False, 'shape': (";
  for (int i = 0; i < t.rank(); ++i) dict += std::to_string(t.size(i)) + (t.rank() == 1 ? ",)" : (i + 1 < t.rank() ? ", " : ")"));
  if (t.rank() == 0) dict += ")";
  dict += ", }";
  // magic (6) + version (2) + length (2) + dict + padding + '\n' is a multiple of 64.
  const size_t unpadded = 10 + dict.size() + 1;
  dict.append((64 - unpadded % 64) % 64, ' ');
  dict += '\n';
  std::vector<std::byte> file(10 + dict.size() + static_cast<size_t>(t.numel()) * 4);
  const unsigned char prefix[] = {0x93, 'N', 'U', 'M', 'P', 'Y', 1, 0,
                                  static_cast<unsigned char>(dict.size() & 0xff), static_cast<unsigned char>(dict.size() >> 8)};
  std::memcpy(file.data(), prefix, 10);
  std::memcpy(file.data() + 10, dict.data(), dict.size());
  if (t.numel() > 0) std::memcpy(file.data() + 10 + dict.size(), t.data(), static_cast<size_t>(t.numel()) * 4);
  write_file_atomically(path, file);
}

}  // namespace qkv::io
