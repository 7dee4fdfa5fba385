// GGUF: the writer and reader round-trip every metadata type and tensor layouts; hostile files made here byte by
// byte are each refused with an IoError naming the problem (never a crash, another exception or a huge allocation:
// a 2^64 count that reached an allocation would throw std::length_error / bad_alloc, which these tests catch as
// failures). MappedFile and AtomicFileWriter are tested here too, as the reader's and writer's foundations.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cctype>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>

#include "qkv/core/error.hpp"
#include "qkv/io/file.hpp"
#include "qkv/io/gguf.hpp"
#include "qkv/kernels/memory.hpp"
#include "helpers.hpp"

namespace qkv::test {
namespace {

using io::GgmlType;
using io::GgufFile;
using io::GgufType;
using io::GgufValue;

std::string scratch(const std::string& name) {
  return (std::filesystem::temp_directory_path() / ("qkv_gguf_" + std::to_string(getpid()) + "_" + name)).string();
}

std::vector<std::byte> file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::vector<char> chars((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<std::byte> out(chars.size());
  if (!chars.empty()) std::memcpy(out.data(), chars.data(), chars.size());
  return out;
}

// A GGUF file built by hand, field by field, little-endian.
struct Builder {
  std::vector<std::byte> b;
  template <typename T>
  Builder& put(T v) {
    const auto* p = reinterpret_cast<const std::byte*>(&v);
    b.insert(b.end(), p, p + sizeof v);
    return *this;
  }
  Builder& u32(uint32_t v) { return put(v); }
  Builder& u64(uint64_t v) { return put(v); }
  Builder& str(std::string_view s) {
    u64(s.size());
    const auto* p = reinterpret_cast<const std::byte*>(s.data());
    b.insert(b.end(), p, p + s.size());
    return *this;
  }
  Builder& header(uint64_t tensors, uint64_t kvs, uint32_t version = 3) {
    b.insert(b.end(), {std::byte{'G'}, std::byte{'G'}, std::byte{'U'}, std::byte{'F'}});
    return u32(version).u64(tensors).u64(kvs);
  }
  Builder& kv_u32(std::string_view key, uint32_t v) { return str(key).u32(4).u32(v); }
  Builder& kv_string(std::string_view key, std::string_view v) { return str(key).u32(8).str(v); }
  Builder& tensor(std::string_view name, std::vector<uint64_t> dims, uint32_t type, uint64_t offset) {
    str(name).u32(static_cast<uint32_t>(dims.size()));
    for (uint64_t d : dims) u64(d);
    return u32(type).u64(offset);
  }
  Builder& pad(size_t alignment = 32) {
    b.resize((b.size() + alignment - 1) / alignment * alignment);
    return *this;
  }
  Builder& zeros(size_t n) {
    b.resize(b.size() + n);
    return *this;
  }
};

// Parsing `bytes` must throw an IoError whose message starts with the label and contains every fragment.
void expect_refused(const std::vector<std::byte>& bytes, std::initializer_list<std::string> fragments) {
  try {
    GgufFile::parse(bytes, "bad.gguf");
    ADD_FAILURE() << "accepted a file that should fail with: " << *fragments.begin();
  } catch (const IoError& e) {
    const std::string message = e.what();
    EXPECT_EQ(message.rfind("bad.gguf: ", 0), 0u) << message;
    for (const std::string& fragment : fragments) EXPECT_NE(message.find(fragment), std::string::npos) << message;
  }
}

// A small valid file: two metadata entries, an F32 (3, 4) and a Q8_0 (2, 32) tensor.
std::vector<std::byte> small_valid_file() {
  Builder f;
  f.header(2, 2).kv_string("general.architecture", "llama").kv_u32("general.alignment", 32);
  f.tensor("a", {4, 3}, 0, 0).tensor("b", {32, 2}, 8, 64);
  f.pad().zeros(48).pad().zeros(68);
  return f.b;
}

TEST(Gguf, TypeTableMatchesGgmlBlockStructs) {
  // ggml-common.h's static_asserts give these sizes; QK_K = 256.
  const std::pair<GgmlType, std::pair<int64_t, int64_t>> expected[] = {
      {GgmlType::F32, {1, 4}},        {GgmlType::F16, {1, 2}},         {GgmlType::BF16, {1, 2}},
      {GgmlType::Q4_0, {32, 18}},     {GgmlType::Q4_1, {32, 20}},      {GgmlType::Q5_0, {32, 22}},
      {GgmlType::Q5_1, {32, 24}},     {GgmlType::Q8_0, {32, 34}},      {GgmlType::Q8_1, {32, 36}},
      {GgmlType::Q2_K, {256, 84}},    {GgmlType::Q3_K, {256, 110}},    {GgmlType::Q4_K, {256, 144}},
      {GgmlType::Q5_K, {256, 176}},   {GgmlType::Q6_K, {256, 210}},    {GgmlType::Q8_K, {256, 292}},
      {GgmlType::IQ2_XXS, {256, 66}}, {GgmlType::IQ2_XS, {256, 74}},   {GgmlType::IQ3_XXS, {256, 98}},
      {GgmlType::IQ1_S, {256, 50}},   {GgmlType::IQ4_NL, {32, 18}},    {GgmlType::IQ3_S, {256, 110}},
      {GgmlType::IQ2_S, {256, 82}},   {GgmlType::IQ4_XS, {256, 136}},  {GgmlType::IQ1_M, {256, 56}},
      {GgmlType::TQ1_0, {256, 54}},   {GgmlType::TQ2_0, {256, 66}},    {GgmlType::MXFP4, {32, 17}},
      {GgmlType::NVFP4, {64, 36}},    {GgmlType::Q1_0, {128, 18}},     {GgmlType::Q2_0, {64, 18}},
      {GgmlType::I8, {1, 1}},         {GgmlType::I16, {1, 2}},         {GgmlType::I32, {1, 4}},
      {GgmlType::I64, {1, 8}},        {GgmlType::F64, {1, 8}},
  };
  EXPECT_EQ(io::ggml_types().size(), std::size(expected));
  for (const auto& [type, sizes] : expected) {
    const io::GgmlTypeInfo* info = io::ggml_type_info(static_cast<uint32_t>(type));
    ASSERT_NE(info, nullptr) << static_cast<uint32_t>(type);
    EXPECT_EQ(info->block_size, sizes.first) << info->name;
    EXPECT_EQ(info->block_bytes, sizes.second) << info->name;
  }
  EXPECT_EQ(io::ggml_type_name(GgmlType::Q4_K), "Q4_K");
  EXPECT_EQ(io::ggml_type_name(31), "removed type Q4_0_4_4");
  EXPECT_EQ(io::ggml_type_name(99), "ggml type 99 (unknown)");
  EXPECT_EQ(io::ggml_type_info(4), nullptr);
  EXPECT_EQ(io::ggml_bytes(GgmlType::Q6_K, 512), 420u);
}

// Every metadata type, arrays of each, nested and empty arrays, and tensors of several layouts, written and read.
TEST(Gguf, RoundTripsEveryMetadataTypeAndTensors) {
  const std::vector<float> f32s = {1.5f, -0.0f, std::numeric_limits<float>::infinity()};
  const std::vector<uint8_t> u8s = {0, 255};
  const std::vector<int8_t> i8s = {-128, 127};
  const std::vector<uint16_t> u16s = {0, 65535};
  const std::vector<int16_t> i16s = {-32768, 32767};
  const std::vector<uint32_t> u32s = {0, 4294967295u};
  const std::vector<int32_t> i32s = {std::numeric_limits<int32_t>::min(), 7};
  const std::vector<uint64_t> u64s = {0, std::numeric_limits<uint64_t>::max()};
  const std::vector<int64_t> i64s = {std::numeric_limits<int64_t>::min(), 3};
  const std::vector<double> f64s = {0.1, -1e300};
  std::vector<std::pair<std::string, GgufValue>> metadata = {
      {"general.architecture", GgufValue::string("llama")},
      {"t.u8", GgufValue::u8(200)},
      {"t.i8", GgufValue::i8(-5)},
      {"t.u16", GgufValue::u16(60000)},
      {"t.i16", GgufValue::i16(-30000)},
      {"t.u32", GgufValue::u32(4000000000u)},
      {"t.i32", GgufValue::i32(-2000000000)},
      {"t.f32", GgufValue::f32(0.25f)},
      {"t.bool", GgufValue::boolean(true)},
      {"t.string", GgufValue::string(std::string("caf\xc3\xa9 \0 z", 9))},
      {"t.u64", GgufValue::u64(18000000000000000000ull)},
      {"t.i64", GgufValue::i64(-9000000000000000000ll)},
      {"t.f64", GgufValue::f64(-2.5e-310)},
      {"a.u8", GgufValue::u8s(u8s)},
      {"a.i8", GgufValue::i8s(i8s)},
      {"a.u16", GgufValue::u16s(u16s)},
      {"a.i16", GgufValue::i16s(i16s)},
      {"a.u32", GgufValue::u32s(u32s)},
      {"a.i32", GgufValue::i32s(i32s)},
      {"a.f32", GgufValue::f32s(f32s)},
      {"a.bool", GgufValue::booleans({true, false, true})},
      {"a.string", GgufValue::strings({"", "a", "Ġhello"})},
      {"a.u64", GgufValue::u64s(u64s)},
      {"a.i64", GgufValue::i64s(i64s)},
      {"a.f64", GgufValue::f64s(f64s)},
      {"a.empty", GgufValue::empty_array(GgufType::I32)},
      {"a.nested", GgufValue::arrays({GgufValue::i32s(i32s), GgufValue::strings({"x", "yz"}),
                                      GgufValue::arrays({GgufValue::f64s(f64s), GgufValue::empty_array(GgufType::String)}),
                                      GgufValue::empty_array(GgufType::Array)})},
  };
  std::vector<float> weights(12);
  for (size_t i = 0; i < weights.size(); ++i) weights[i] = 0.5f * static_cast<float>(i) - 2.0f;
  std::vector<std::byte> q8(2 * 34), q4k(144 * 3), scalar(4);
  for (size_t i = 0; i < q8.size(); ++i) q8[i] = std::byte(i * 7);
  for (size_t i = 0; i < q4k.size(); ++i) q4k[i] = std::byte(i * 13 + 1);
  scalar[0] = std::byte{42};
  const std::vector<io::GgufTensorData> tensors = {
      {"token_embd.weight", {4, 3}, GgmlType::F32, std::as_bytes(std::span(weights))},
      {"blk.0.attn_q.weight", {32, 2}, GgmlType::Q8_0, q8},
      {"blk.0.ffn_up.weight", {256, 1, 3}, GgmlType::Q4_K, q4k},
      {"empty", {0, 5}, GgmlType::F16, {}},
      {"scalar", {}, GgmlType::I32, scalar},
  };
  const std::string path = scratch("roundtrip.gguf");
  io::save_gguf(path, metadata, tensors);

  const GgufFile file = GgufFile::open(path);
  EXPECT_EQ(file.version(), 3u);
  EXPECT_EQ(file.alignment(), 32u);
  EXPECT_EQ(file.data_offset() % 32, 0u);
  ASSERT_NE(file.mapping(), nullptr);
  ASSERT_EQ(file.metadata().size(), metadata.size());
  for (size_t i = 0; i < metadata.size(); ++i) {
    EXPECT_EQ(file.metadata()[i].first, metadata[i].first);
    EXPECT_TRUE(file.metadata()[i].second == metadata[i].second) << metadata[i].first;
  }
  // Typed getters across widths.
  EXPECT_EQ(file.string("general.architecture"), "llama");
  EXPECT_EQ(file.integer("t.u8"), 200);
  EXPECT_EQ(file.integer("t.i8"), -5);
  EXPECT_EQ(file.integer("t.u16"), 60000);
  EXPECT_EQ(file.integer("t.i16"), -30000);
  EXPECT_EQ(file.integer("t.u32"), 4000000000ll);
  EXPECT_EQ(file.integer("t.i32"), -2000000000);
  EXPECT_EQ(file.integer("t.i64"), -9000000000000000000ll);
  EXPECT_EQ(file.value("t.u64").as_uint64(), 18000000000000000000ull);
  EXPECT_EQ(file.real("t.f32"), 0.25);
  EXPECT_EQ(file.real("t.f64"), -2.5e-310);
  EXPECT_TRUE(file.boolean("t.bool"));
  EXPECT_EQ(file.string("t.string"), std::string("caf\xc3\xa9 \0 z", 9));
  EXPECT_EQ(file.strings("a.string"), (std::vector<std::string>{"", "a", "Ġhello"}));
  EXPECT_EQ(file.integers("a.i8"), (std::vector<int64_t>{-128, 127}));
  EXPECT_EQ(file.integers("a.u32"), (std::vector<int64_t>{0, 4294967295ll}));
  EXPECT_EQ(file.integers("a.i64"), i64s);
  EXPECT_EQ(file.floats("a.f32")[0], 1.5f);
  EXPECT_TRUE(std::signbit(file.floats("a.f32")[1]));
  EXPECT_TRUE(std::isinf(file.floats("a.f32")[2]));
  EXPECT_EQ(file.floats("a.f64")[1], static_cast<float>(-1e300));  // -inf once narrowed: f64 → float
  EXPECT_TRUE(file.integers("a.empty").empty());
  const auto& nested = file.value("a.nested").as_arrays();
  ASSERT_EQ(nested.size(), 4u);
  EXPECT_EQ(nested[1].as_strings()[1], "yz");
  EXPECT_EQ(nested[2].as_arrays()[0].as_doubles()[0], 0.1);
  EXPECT_EQ(nested[3].element_type(), GgufType::Array);
  EXPECT_EQ(file.value("a.nested").type_text(), "array of array");

  ASSERT_EQ(file.tensors().size(), tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const io::GgufTensor& t = file.tensors()[i];
    EXPECT_EQ(t.name, tensors[i].name);
    EXPECT_EQ(t.dims, tensors[i].dims);
    EXPECT_EQ(t.type, tensors[i].type);
    EXPECT_EQ(t.bytes, tensors[i].bytes.size());
    EXPECT_EQ(t.offset % 32, 0u);
    if (t.bytes) {
      // In place: the tensor's bytes are in the mapping, not a copy.
      EXPECT_GE(t.data, file.mapping()->data());
      EXPECT_LE(t.data + t.bytes, file.mapping()->data() + file.mapping()->size());
      EXPECT_EQ(std::memcmp(t.data, tensors[i].bytes.data(), t.bytes), 0) << t.name;
    } else {
      EXPECT_EQ(t.data, nullptr);
    }
  }
  const io::GgufTensor& q4 = file.tensor("blk.0.ffn_up.weight");
  EXPECT_EQ(q4.shape(), (std::vector<int64_t>{3, 1, 256}));
  EXPECT_EQ(q4.numel(), 768);
  EXPECT_EQ(file.tensor("scalar").numel(), 1);
  EXPECT_EQ(file.find("missing"), nullptr);
  std::filesystem::remove(path);
}

TEST(Gguf, GettersNameTheKeyAndBothTypes) {
  const std::string path = scratch("getters.gguf");
  io::save_gguf(path, {{"general.alignment", GgufValue::u32(64)}, {"big", GgufValue::u64(~0ull)},
                       {"neg", GgufValue::i8s(std::vector<int8_t>{-1})}, {"s", GgufValue::strings({"a"})}},
                {});
  const GgufFile file = GgufFile::open(path);
  EXPECT_EQ(file.alignment(), 64u);
  auto expect_message = [](auto&& body, std::initializer_list<std::string> fragments) {
    try {
      body();
      ADD_FAILURE() << "no error";
    } catch (const IoError& e) {
      for (const auto& f : fragments) EXPECT_NE(std::string(e.what()).find(f), std::string::npos) << e.what();
    }
  };
  expect_message([&] { (void)file.string("general.alignment"); }, {"'general.alignment' is u32, expected a string"});
  expect_message([&] { (void)file.real("big"); }, {"'big' is u64, expected a float"});
  expect_message([&] { (void)file.integer("big"); }, {"'big'", "beyond int64"});
  expect_message([&] { (void)file.integer("s"); }, {"'s' is array of str, expected an integer"});
  expect_message([&] { (void)file.strings("neg"); }, {"'neg' is array of i8, expected an array of str"});
  expect_message([&] { (void)file.boolean("absent.key"); }, {"has no metadata key 'absent.key'"});
  expect_message([&] { (void)file.tensor("w"); }, {"has no tensor 'w'"});
  EXPECT_THROW((void)file.value("neg").as_floats(), ValueError);
  std::filesystem::remove(path);
}

TEST(Gguf, ReadsVersion2AndOtherAlignments) {
  std::vector<std::byte> v2 = small_valid_file();
  v2[4] = std::byte{2};
  const GgufFile file = GgufFile::parse(v2, "v2.gguf");
  EXPECT_EQ(file.version(), 2u);
  ASSERT_EQ(file.tensors().size(), 2u);
  EXPECT_EQ(file.tensor("b").bytes, 68u);
  EXPECT_EQ(file.tensor("b").data, file.tensor("a").data + 64);

  // general.alignment 64, written and read; alignment 1 (a power of two) accepted.
  std::vector<float> w(3, 1.0f);
  const std::string path = scratch("align.gguf");
  io::save_gguf(path, {{"general.alignment", GgufValue::u32(64)}},
                {{"x", {3}, GgmlType::F32, std::as_bytes(std::span(w))}, {"y", {3}, GgmlType::F32, std::as_bytes(std::span(w))}});
  const GgufFile aligned = GgufFile::open(path);
  EXPECT_EQ(aligned.data_offset() % 64, 0u);
  EXPECT_EQ(aligned.tensor("y").offset, 64u);
  Builder one;
  one.header(1, 1).kv_u32("general.alignment", 1).tensor("t", {2}, 24, 0).zeros(2);
  EXPECT_EQ(GgufFile::parse(one.b, "one.gguf").tensor("t").bytes, 2u);
  std::filesystem::remove(path);
}

TEST(Gguf, RefusesHostileHeaders) {
  Builder magic;
  magic.b = {std::byte{'G'}, std::byte{'G'}, std::byte{'M'}, std::byte{'L'}};
  magic.u32(3).u64(0).u64(0);
  expect_refused(magic.b, {"not a GGUF file", "'GGML'"});
  expect_refused(Builder().header(0, 0, 1).b, {"GGUF version 1", "convert the model again"});
  expect_refused(Builder().header(0, 0, 0x03000000).b, {"big-endian", "version 3 byte-swapped"});
  expect_refused(Builder().header(0, 0, 4).b, {"GGUF version 4 is not one qkv reads"});
  expect_refused(Builder().header(0, 0, 0).b, {"GGUF version 0"});
  expect_refused(Builder().header(~0ull, 0).b, {"counts 18446744073709551615 tensors"});
  expect_refused(Builder().header(0, ~0ull).b, {"counts 18446744073709551615 metadata entries"});
  expect_refused(Builder().header(0, 1).u64(~0ull).zeros(8).b, {"metadata key #0 is 18446744073709551615 bytes long"});
  expect_refused(Builder().header(0, 1).u64(70000).zeros(70000).b, {"metadata key #0 is 70000 bytes long", "at most 65535"});
  expect_refused(Builder().header(0, 1).str("").u32(0).zeros(2).b, {"metadata key #0 is empty"});
  expect_refused(Builder().header(0, 1).str("k").u32(8).u64(~0ull - 3).b,
                 {"metadata 'k' is 18446744073709551612 bytes long, but only 0 bytes"});
  expect_refused(Builder().header(0, 1).str("k").u32(9).u32(8).u64(~0ull).b,
                 {"metadata 'k' is an array of 18446744073709551615 str elements"});
  expect_refused(Builder().header(0, 1).str("k").u32(9).u32(4).u64(uint64_t{1} << 62).zeros(64).b,
                 {"array of 4611686018427387904 u32 elements", "hold at most 16"});
  // An array of arrays whose inner array claims 2^64 - 1 elements.
  expect_refused(Builder().header(0, 1).str("k").u32(9).u32(9).u64(1).u32(0).u64(~0ull).b,
                 {"metadata 'k'[0] is an array of 18446744073709551615 u8 elements"});
  expect_refused(Builder().header(0, 1).str("k").u32(13).zeros(8).b, {"metadata 'k' has value type 13"});
  expect_refused(Builder().header(0, 1).str("k").u32(9).u32(77).u64(0).b, {"the elements of metadata 'k' has value type 77"});
  expect_refused(Builder().header(0, 1).str("k").u32(7).put<uint8_t>(2).b, {"bool holding 2", "0 or 1"});
  expect_refused(Builder().header(0, 1).str("k").u32(9).u32(7).u64(2).put<uint8_t>(1).put<uint8_t>(9).b,
                 {"metadata 'k'[1] is a bool holding 9"});
  expect_refused(Builder().header(0, 2).kv_u32("a", 1).kv_u32("a", 2).b, {"metadata key 'a' appears twice"});
  // Arrays nested 65 deep.
  Builder deep;
  deep.header(0, 1).str("k").u32(9);
  for (int i = 0; i < 70; ++i) deep.u32(9).u64(1);
  deep.u32(0).u64(0);
  expect_refused(deep.b, {"nests arrays more than 64 deep"});
  // A key printed safely: control bytes escaped.
  expect_refused(Builder().header(0, 2).kv_u32("\x1b[31m", 1).kv_u32("\x1b[31m", 2).b, {"'\\x1b[31m' appears twice"});
}

TEST(Gguf, RefusesBadAlignment) {
  expect_refused(Builder().header(0, 1).kv_u32("general.alignment", 0).b, {"general.alignment is 0", "power of two"});
  expect_refused(Builder().header(0, 1).kv_u32("general.alignment", 3).b, {"general.alignment is 3", "power of two"});
  expect_refused(Builder().header(0, 1).str("general.alignment").u32(5).u32(32).b,
                 {"general.alignment is i32; it must be a u32"});
}

TEST(Gguf, RefusesHostileTensorTables) {
  auto one_tensor = [](std::vector<uint64_t> dims, uint32_t type, uint64_t offset, size_t data = 64) {
    Builder f;
    f.header(1, 0).tensor("w", std::move(dims), type, offset).pad().zeros(data);
    return f.b;
  };
  expect_refused(one_tensor({1, 1, 1, 1, 1}, 0, 0), {"tensor 'w' has 5 dims", "at most 4"});
  expect_refused(one_tensor({uint64_t{1} << 32, uint64_t{1} << 32}, 0, 0), {"dims [4294967296, 4294967296]", "more than 2^63"});
  expect_refused(one_tensor({~0ull}, 0, 0), {"dim 0 of tensor 'w' is 18446744073709551615", "negative"});
  // Elements fit int64, bytes do not fit 2^64: 2^62 F64 elements.
  expect_refused(one_tensor({uint64_t{1} << 62}, 28, 0), {"more bytes than 2^64"});
  expect_refused(one_tensor({4}, 0, 64), {"tensor 'w' (F32, 16 bytes at offset 64", "runs past the end"});
  expect_refused(one_tensor({4}, 0, ~0ull - 31), {"runs past the end"});
  expect_refused(one_tensor({4}, 0, 16), {"offset 16", "not a multiple of the alignment 32"});
  expect_refused(one_tensor({4}, 99, 0), {"tensor 'w': ggml type 99 is unknown"});
  expect_refused(one_tensor({4}, 4, 0), {"ggml type 4 (Q4_2), which ggml removed"});
  expect_refused(one_tensor({4}, 31, 0), {"ggml type 31 (Q4_0_4_4), which ggml removed"});
  expect_refused(one_tensor({33, 1}, 8, 0), {"'w' is Q8_0", "blocks of 32", "rows (ne0) hold 33"});
  expect_refused(one_tensor({128}, 12, 0), {"'w' is Q4_K", "blocks of 256", "rows (ne0) hold 128"});
  expect_refused(Builder().header(1, 0).str(std::string(65, 'n')).b, {"the name of tensor #0 is 65 bytes long"});
  expect_refused(Builder().header(1, 0).tensor("", {4}, 0, 0).pad().zeros(16).b, {"tensor #0 has an empty name"});
  expect_refused(Builder().header(2, 0).tensor("w", {4}, 0, 0).tensor("w", {4}, 0, 32).pad().zeros(64).b,
                 {"tensor 'w' appears twice"});
  expect_refused(Builder().header(2, 0).tensor("a", {16}, 0, 0).tensor("b", {4}, 0, 32).pad().zeros(96).b,
                 {"tensors 'a' (bytes 0 to 64) and 'b' (from 32) overlap"});
  // Listed out of offset order, still overlapping.
  expect_refused(Builder().header(2, 0).tensor("b", {4}, 0, 32).tensor("a", {16}, 0, 0).pad().zeros(96).b,
                 {"'a' (bytes 0 to 64) and 'b' (from 32) overlap"});
  expect_refused(Builder().header(1, 0).tensor("w", {4}, 0, 0).b, {"truncated", "data section would start at offset"});
  expect_refused(Builder().header(uint64_t{1} << 40, 0).tensor("w", {4}, 0, 0).b, {"counts 1099511627776 tensors"});
  expect_refused(Builder().header(1, 0).str("w").u32(4).u64(1).u64(1).b, {"truncated: dim 2 of tensor 'w' needs 8 bytes"});

  // Out of offset order, not overlapping, with an empty tensor between: accepted, pointers where the offsets say.
  Builder ok;
  ok.header(3, 0).tensor("b", {8}, 0, 32).tensor("e", {0}, 0, 32).tensor("a", {8}, 0, 0).pad().zeros(64);
  const GgufFile file = GgufFile::parse(ok.b, "ok.gguf");
  EXPECT_EQ(file.tensor("b").data, file.tensor("a").data + 32);
}

// Every prefix of a valid file that ends before its last tensor's bytes is refused as cut short.
TEST(Gguf, RefusesTruncationAtEveryByte) {
  std::vector<float> w(40, 1.0f);
  const std::string path = scratch("trunc.gguf");
  io::save_gguf(path,
                {{"general.architecture", GgufValue::string("qwen3")},
                 {"tokenizer.ggml.tokens", GgufValue::strings({"a", "bb", "ccc"})},
                 {"tokenizer.ggml.scores", GgufValue::f32s(std::vector<float>{0.f, -1.f, -2.f})},
                 {"nested", GgufValue::arrays({GgufValue::u16s(std::vector<uint16_t>{1, 2})})}},
                {{"x", {8, 5}, GgmlType::F32, std::as_bytes(std::span(w))},
                 {"y", {8, 5}, GgmlType::F32, std::as_bytes(std::span(w))}});
  const std::vector<std::byte> full = file_bytes(path);
  const GgufFile whole = GgufFile::parse(full, "whole.gguf");
  const uint64_t data_end = whole.data_offset() + whole.tensor("y").offset + whole.tensor("y").bytes;
  ASSERT_LE(data_end, full.size());
  int refused = 0;
  for (size_t n = 0; n < data_end; ++n) {
    const std::vector<std::byte> prefix(full.begin(), full.begin() + static_cast<std::ptrdiff_t>(n));
    try {
      GgufFile::parse(prefix, "cut.gguf");
      ADD_FAILURE() << "a prefix of " << n << " bytes was accepted";
    } catch (const IoError& e) {
      const std::string message = e.what();
      const bool named = n < 4 ? message.find("not a GGUF file") != std::string::npos
                               : message.find("cut short") != std::string::npos ||
                                     message.find("truncated") != std::string::npos;
      EXPECT_TRUE(named) << n << ": " << message;
      ++refused;
    }
  }
  EXPECT_EQ(refused, static_cast<int>(data_end));
  // From the end of the last tensor on, only padding is missing: the tensors are whole.
  const std::vector<std::byte> unpadded(full.begin(), full.begin() + static_cast<std::ptrdiff_t>(data_end));
  EXPECT_EQ(GgufFile::parse(unpadded, "unpadded.gguf").tensors().size(), 2u);
  std::filesystem::remove(path);
}

TEST(Gguf, WriterStreamsPiecesAndMatchesTheOneCallWriter) {
  std::vector<std::byte> a(34 * 4), b(4 * 7);
  for (size_t i = 0; i < a.size(); ++i) a[i] = std::byte(i);
  for (size_t i = 0; i < b.size(); ++i) b[i] = std::byte(255 - i);
  const std::string whole = scratch("whole.gguf"), streamed = scratch("streamed.gguf");
  io::save_gguf(whole, {{"general.name", GgufValue::string("t")}},
                {{"a", {64, 2}, GgmlType::Q8_0, a}, {"none", {0}, GgmlType::F32, {}}, {"b", {7}, GgmlType::F32, b}});
  {
    io::GgufWriter writer(streamed);
    writer.add_metadata("general.name", GgufValue::string("t"));
    EXPECT_EQ(writer.add_tensor("a", {64, 2}, GgmlType::Q8_0), a.size());
    EXPECT_EQ(writer.add_tensor("none", {0}, GgmlType::F32), 0u);
    EXPECT_EQ(writer.add_tensor("b", {7}, GgmlType::F32), b.size());
    // Pieces of 5 bytes that cross from a into b.
    std::vector<std::byte> all = a;
    all.insert(all.end(), b.begin(), b.end());
    for (size_t at = 0; at < all.size(); at += 5)
      writer.write_tensor_data(std::span(all).subspan(at, std::min<size_t>(5, all.size() - at)));
    writer.finish();
  }
  EXPECT_EQ(file_bytes(whole), file_bytes(streamed));
  EXPECT_EQ(file_bytes(whole).size() % 32, 0u);  // each tensor padded to the alignment, the last one too
  std::filesystem::remove(whole);
  std::filesystem::remove(streamed);
}

TEST(Gguf, WriterRefusesMistakesAndLeavesNothingBehind) {
  const std::string path = scratch("mistakes.gguf");
  auto expect_value_error = [](auto&& body, const std::string& fragment) {
    try {
      body();
      ADD_FAILURE() << "no error for " << fragment;
    } catch (const ValueError& e) {
      EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
    }
  };
  {
    io::GgufWriter w(path);
    w.add_metadata("k", GgufValue::u8(1));
    expect_value_error([&] { w.add_metadata("k", GgufValue::u8(2)); }, "metadata key 'k' is given twice");
    expect_value_error([&] { w.add_metadata("", GgufValue::u8(2)); }, "a metadata key is empty");
    expect_value_error([&] { w.add_metadata("general.alignment", GgufValue::u64(32)); }, "must be a u32");
    expect_value_error([&] { w.add_metadata("general.alignment", GgufValue::u32(48)); }, "48 is not a power of two");
    w.add_tensor("t", {32}, GgmlType::Q8_0);
    expect_value_error([&] { w.add_tensor("t", {32}, GgmlType::F32); }, "two tensors are named 't'");
    expect_value_error([&] { w.add_tensor(std::string(64, 'x'), {32}, GgmlType::F32); }, "llama.cpp reads at most 63");
    expect_value_error([&] { w.add_tensor("u", {1, 1, 1, 1, 1}, GgmlType::F32); }, "5 dims");
    expect_value_error([&] { w.add_tensor("u", {100}, GgmlType::Q4_K); }, "rows (ne0) hold 100");
    expect_value_error([&] { w.add_tensor("u", {4}, static_cast<GgmlType>(31)); }, "removed type Q4_0_4_4");
    expect_value_error([&] { w.add_tensor("u", {-1}, GgmlType::F32); }, "negative dim");
    const std::vector<std::byte> too_many(40);
    expect_value_error([&] { w.write_tensor_data(too_many); }, "6 bytes more than the declared tensors hold");
    // Abandoned (destroyed without finish): neither the file nor its temporary exists.
  }
  EXPECT_FALSE(std::filesystem::exists(path));
  EXPECT_FALSE(std::filesystem::exists(path + ".tmp." + std::to_string(getpid())));
  {
    io::GgufWriter w(path);
    w.add_tensor("t", {32}, GgmlType::Q8_0);
    w.write_tensor_data(std::vector<std::byte>(10));
    expect_value_error([&] { w.finish(); }, "tensor 't' got 10 of its 34 bytes");
  }
  EXPECT_FALSE(std::filesystem::exists(path));
  expect_value_error([&] { io::save_gguf(path, {}, {{"t", {32}, GgmlType::Q8_0, std::vector<std::byte>(30)}}); },
                     "given 30 bytes; its dims and type take 34");
  EXPECT_FALSE(std::filesystem::exists(path));
}

TEST(Gguf, RequireTypesNamesTheTensorAndItsType) {
  const std::string path = scratch("iq.gguf");
  const std::vector<std::byte> block(66);
  io::save_gguf(path, {}, {{"blk.0.ffn_down.weight", {256}, GgmlType::IQ2_XXS, block}});
  const GgufFile file = GgufFile::open(path);
  const GgmlType supported[] = {GgmlType::F32, GgmlType::Q8_0};
  try {
    file.require_types(supported);
    ADD_FAILURE() << "IQ2_XXS accepted";
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find("tensor 'blk.0.ffn_down.weight' is IQ2_XXS, which qkv cannot compute with; "
                                         "it reads F32, Q8_0"),
              std::string::npos)
        << e.what();
  }
  const GgmlType all[] = {GgmlType::IQ2_XXS};
  EXPECT_NO_THROW(file.require_types(all));
  std::filesystem::remove(path);
}

// A file llama.cpp wrote (llama_model_quantize to Q4_K_M of tools/tiny_llama_gguf.cpp's F32 model, through
// tools/llamacpp.c): qkv reads its metadata and tensor table, and the tensors lie back to back as llama.cpp lays them.
TEST(Gguf, ReadsAFileLlamaCppQuantized) {
  const GgufFile file = GgufFile::open(std::string(QKV_FIXTURES) + "/gguf/tiny-llama-q4_k_m.gguf");
  EXPECT_EQ(file.version(), 3u);
  EXPECT_EQ(file.string("general.architecture"), "llama");
  EXPECT_EQ(file.integer("general.file_type"), 15);  // LLAMA_FTYPE_MOSTLY_Q4_K_M
  EXPECT_EQ(file.integer("general.quantization_version"), 2);
  EXPECT_EQ(file.integer("llama.embedding_length"), 64);
  EXPECT_EQ(file.strings("tokenizer.ggml.tokens").size(), 265u);
  EXPECT_EQ(file.strings("tokenizer.ggml.tokens")[3 + 0x41], "<0x41>");
  EXPECT_EQ(file.floats("tokenizer.ggml.scores").size(), 265u);
  EXPECT_EQ(file.integers("tokenizer.ggml.token_type")[1], 3);
  ASSERT_EQ(file.tensors().size(), 21u);
  std::map<std::string, int> types;
  uint64_t expected_offset = 0;
  for (const io::GgufTensor& t : file.tensors()) {
    ++types[io::ggml_type_name(t.type)];
    EXPECT_EQ(t.offset, expected_offset) << t.name;
    expected_offset += (t.bytes + 31) / 32 * 32;
  }
  // 64 columns are not a multiple of 256: llama.cpp falls back from Q4_K / Q6_K to Q5_0 and Q8_0.
  EXPECT_EQ(types, (std::map<std::string, int>{{"F32", 5}, {"Q5_0", 13}, {"Q8_0", 3}}));
  const io::GgufTensor& embedding = file.tensor("token_embd.weight");
  EXPECT_EQ(embedding.shape(), (std::vector<int64_t>{265, 64}));
  EXPECT_EQ(file.tensor("blk.1.ffn_down.weight").dims, (std::vector<int64_t>{128, 64}));
  EXPECT_EQ(file.data_offset() + expected_offset, file.file_size());
}

// A metadata value as node-llama-cpp's parser gives it in JSON: 64-bit integers as decimal strings (BigInt),
// narrower integers and floats as numbers, arrays as arrays.
nlohmann::json as_js(const GgufValue& v) {
  if (v.is_array()) {
    nlohmann::json out = nlohmann::json::array();
    if (v.element_type() == GgufType::Array) {
      for (const GgufValue& item : v.as_arrays()) out.push_back(as_js(item));
      return out;
    }
    if (v.element_type() == GgufType::String) return v.as_strings();
    // A fixed-size array: each element as its own scalar.
    const size_t step = v.raw().size() / std::max<uint64_t>(v.size(), 1);
    for (uint64_t i = 0; i < v.size(); ++i) {
      Builder one;
      one.str("k").u32(static_cast<uint32_t>(v.element_type()));
      one.b.insert(one.b.end(), v.raw().begin() + static_cast<std::ptrdiff_t>(i * step),
                   v.raw().begin() + static_cast<std::ptrdiff_t>((i + 1) * step));
      Builder file;
      file.header(0, 1).b.insert(file.b.end(), one.b.begin(), one.b.end());
      out.push_back(as_js(GgufFile::parse(file.b).value("k")));
    }
    return out;
  }
  switch (v.type()) {
    case GgufType::String: return v.as_string();
    case GgufType::Bool: return v.as_bool();
    case GgufType::F32: case GgufType::F64: return v.as_double();
    case GgufType::U64: return std::to_string(v.as_uint64());
    case GgufType::I64: return std::to_string(v.as_int64());
    default: return v.as_int64();
  }
}

// llama.cpp's npm package (node-llama-cpp, its JS GGUF parser) reads the metadata and tensor table qkv writes.
// Needs node-llama-cpp in QKV_NODE_LLAMA_CPP (a node_modules folder) or .cache/node/node_modules, where scripts/run
// test installs it; without it the test skips, except under scripts/run test (QKV_REQUIRE_LLAMACPP=1), where it fails.
TEST(Gguf, NodeLlamaCppReadsWhatQkvWrites) {
  const char* env = std::getenv("QKV_NODE_LLAMA_CPP");
  const std::string modules = env ? env : QKV_NODE_MODULES;
  if (!std::filesystem::exists(modules + "/node-llama-cpp/package.json")) {
    const std::string missing = "node-llama-cpp is not in " + modules +
                                " (scripts/run test installs it; or npm install node-llama-cpp@3.22.1 there, or set QKV_NODE_LLAMA_CPP)";
    const char* required = std::getenv("QKV_REQUIRE_LLAMACPP");
    if (required && std::string(required) == "1") FAIL() << missing;
    GTEST_SKIP() << missing;
  }
  const std::vector<float> scores = {0.f, -1.5f, -2.25f};
  const std::vector<std::pair<std::string, GgufValue>> metadata = {
      {"general.architecture", GgufValue::string("llama")},
      {"general.alignment", GgufValue::u32(64)},
      {"general.name", GgufValue::string("qkv \xe2\x9c\x93 \"test\"")},
      {"llama.block_count", GgufValue::u32(2)},
      {"llama.rope.freq_base", GgufValue::f32(500000.f)},
      {"llama.attention.layer_norm_rms_epsilon", GgufValue::f32(1e-5f)},
      {"t.u8", GgufValue::u8(255)},
      {"t.i8", GgufValue::i8(-128)},
      {"t.u16", GgufValue::u16(65535)},
      {"t.i16", GgufValue::i16(-32768)},
      {"t.i32", GgufValue::i32(-7)},
      {"t.u64", GgufValue::u64(18446744073709551615ull)},
      {"t.i64", GgufValue::i64(-9223372036854775807ll)},
      {"t.f64", GgufValue::f64(0.1)},
      {"t.bool", GgufValue::boolean(false)},
      {"tokenizer.ggml.tokens", GgufValue::strings({"<s>", "\xc4\xa0the", ""})},
      {"tokenizer.ggml.scores", GgufValue::f32s(scores)},
      {"tokenizer.ggml.token_type", GgufValue::i32s(std::vector<int32_t>{3, 1, 1})},
      {"a.u64", GgufValue::u64s(std::vector<uint64_t>{0, 1ull << 63})},
      {"a.bool", GgufValue::booleans({true, false})},
      {"a.nested", GgufValue::arrays({GgufValue::i16s(std::vector<int16_t>{-1, 2}), GgufValue::strings({"x"}),
                                      GgufValue::empty_array(GgufType::F32)})},
  };
  std::vector<std::byte> f32(4 * 64 * 2), f16(2 * 64), q8(34 * 2 * 3), q4k(144 * 2), q6k(210);
  const std::vector<io::GgufTensorData> tensors = {
      {"token_embd.weight", {64, 2}, GgmlType::F32, f32}, {"output_norm.weight", {64}, GgmlType::F16, f16},
      {"blk.0.attn_q.weight", {64, 3}, GgmlType::Q8_0, q8}, {"blk.0.ffn_up.weight", {256, 2}, GgmlType::Q4_K, q4k},
      {"blk.0.ffn_down.weight", {256, 1, 1}, GgmlType::Q6_K, q6k},
  };
  const std::string path = scratch("node.gguf");
  io::save_gguf(path, metadata, tensors);
  const GgufFile file = GgufFile::open(path);

  const std::string command = "node " + std::string(QKV_FIXTURES) + "/../gguf_llamacpp_info.js " + modules + " " + path + " 2>&1";
  FILE* pipe = popen(command.c_str(), "r");
  ASSERT_NE(pipe, nullptr);
  std::string out;
  char buffer[4096];
  while (size_t n = fread(buffer, 1, sizeof buffer, pipe)) out.append(buffer, n);
  ASSERT_EQ(pclose(pipe), 0) << out;
  const nlohmann::json js = nlohmann::json::parse(out);
  EXPECT_EQ(js["version"], 3);
  EXPECT_EQ(js["tensorCount"], tensors.size());
  EXPECT_EQ(js["dataOffset"], file.data_offset());  // the same alignment of the data section (64 here)
  ASSERT_EQ(js["metadata"].size(), metadata.size());
  for (const auto& [key, value] : metadata) {
    ASSERT_TRUE(js["metadata"].contains(key)) << key;
    EXPECT_EQ(js["metadata"][key], as_js(value)) << key << ": " << js["metadata"][key].dump();
  }
  ASSERT_EQ(js["tensors"].size(), tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& t = js["tensors"][i];
    EXPECT_EQ(t["name"], tensors[i].name);
    EXPECT_EQ(t["dims"].get<std::vector<int64_t>>(), tensors[i].dims);
    EXPECT_EQ(t["type"], static_cast<uint32_t>(tensors[i].type));
    EXPECT_EQ(t["offset"], file.tensor(tensors[i].name).offset);
  }
  std::filesystem::remove(path);
}

TEST(MappedFile, MapsMovesAndNamesFailures) {
  const std::string path = scratch("mapped.bin");
  const std::string text = "hello, mapped world";
  io::write_file_atomically(path, std::as_bytes(std::span(text.data(), text.size())));
  io::MappedFile file = io::MappedFile::open(path, io::MapAccess::Random);
  ASSERT_EQ(file.size(), text.size());
  EXPECT_EQ(std::memcmp(file.data(), text.data(), text.size()), 0);
  EXPECT_GE(file.fd(), 0);
  file.advise(0, 5, io::MapAccess::WillNeed);
  file.release(0, file.size());  // no whole page inside 19 bytes: nothing released, still readable
  EXPECT_EQ(std::to_integer<char>(file.data()[0]), 'h');
  const std::byte* address = file.data();
  io::MappedFile moved = std::move(file);
  EXPECT_EQ(moved.data(), address);
  EXPECT_EQ(file.data(), nullptr);
  EXPECT_EQ(file.size(), 0u);
  EXPECT_EQ(file.fd(), -1);
  io::MappedFile assigned;
  assigned = std::move(moved);
  EXPECT_EQ(assigned.data(), address);
  EXPECT_EQ(assigned.path(), path);

  const std::string empty = scratch("empty.bin");
  io::write_file_atomically(empty, {});
  const io::MappedFile nothing = io::MappedFile::open(empty);
  EXPECT_EQ(nothing.size(), 0u);
  EXPECT_EQ(nothing.data(), nullptr);
  expect_refused(std::vector<std::byte>{}, {"not a GGUF file", "only 0 bytes"});
  EXPECT_THROW(GgufFile::open(empty), IoError);

  auto expect_io_error = [](const std::string& p, const std::string& fragment) {
    try {
      io::MappedFile::open(p);
      ADD_FAILURE() << p << " mapped";
    } catch (const IoError& e) {
      EXPECT_EQ(std::string(e.what()).rfind(p + ": ", 0), 0u) << e.what();
      EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
    }
  };
  expect_io_error(scratch("does_not_exist"), "cannot open");
  expect_io_error(std::filesystem::temp_directory_path().string(), "is a directory");
  expect_io_error("/dev/zero", "not a regular file");
  std::filesystem::remove(path);
  std::filesystem::remove(empty);
}

// A converted matrix lets go of the file pages it was read from (memory::release_file_pages): the pages of a registered
// mapping are dropped and read again from the file when touched; any other memory is left as it is (dropping the pages
// of memory that was written would zero it).
// The kB of the mapping starting at `address` resident in this process (/proc/self/smaps), or −1.
long resident_kb(const void* address) {
  std::ifstream smaps("/proc/self/smaps");
  std::string line;
  bool in = false;
  while (std::getline(smaps, line)) {
    if (!line.empty() && std::isxdigit(static_cast<unsigned char>(line[0])) && line.find('-') != std::string::npos)
      in = std::stoull(line.substr(0, line.find('-')), nullptr, 16) == reinterpret_cast<uintptr_t>(address);
    else if (in && line.rfind("Rss:", 0) == 0)
      return std::stol(line.substr(4));
  }
  return -1;
}

TEST(MappedFile, ReleasedPagesReadAgainAndOtherMemoryIsLeftAlone) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE)), n = 4 * page;
  std::vector<unsigned char> bytes(n);
  for (size_t i = 0; i < n; ++i) bytes[i] = static_cast<unsigned char>(i * 7 + 3);
  const std::string path = scratch("released.bin");
  io::write_file_atomically(path, std::as_bytes(std::span(bytes)));
  {
    const io::MappedFile file = io::MappedFile::open(path);
    const auto* mapped = reinterpret_cast<const unsigned char*>(file.data());
    ASSERT_EQ(std::memcmp(mapped, bytes.data(), n), 0);
    const long before = resident_kb(mapped);
    memory::release_file_pages(mapped + 1, n - 1);  // the whole pages inside: 3 of the 4
    if (before >= 0) EXPECT_EQ(resident_kb(mapped), before - static_cast<long>(3 * page / 1024));
    EXPECT_EQ(std::memcmp(mapped, bytes.data(), n), 0);
    memory::release_file_pages(mapped, 2 * n);  // past the mapping's end: not a mapping's range, nothing done
    EXPECT_EQ(std::memcmp(mapped, bytes.data(), n), 0);
  }
  // ordinary memory, page-aligned so that whole pages lie inside: left as it is
  void* raw = std::aligned_alloc(page, n);
  ASSERT_NE(raw, nullptr);
  std::memcpy(raw, bytes.data(), n);
  memory::release_file_pages(raw, n);
  EXPECT_EQ(std::memcmp(raw, bytes.data(), n), 0);
  std::free(raw);
  std::filesystem::remove(path);
}

TEST(AtomicFileWriter, StreamsLargeAndSmallPiecesAndReplacesWhole) {
  const std::string path = scratch("atomic.bin");
  io::write_file_atomically(path, std::as_bytes(std::span("old", 3)));
  std::vector<std::byte> big(3 << 20);
  for (size_t i = 0; i < big.size(); ++i) big[i] = std::byte(i * 31);
  {
    io::AtomicFileWriter out(path);
    out.write(std::span(big).first(10));
    out.write_zeros(5);
    out.write(std::span(big).subspan(10));  // larger than the buffer: written straight through
    EXPECT_EQ(out.written(), big.size() + 5);
    EXPECT_EQ(file_bytes(path).size(), 3u);  // the old file stays until commit
    out.commit();
  }
  const std::vector<std::byte> got = file_bytes(path);
  ASSERT_EQ(got.size(), big.size() + 5);
  EXPECT_EQ(std::memcmp(got.data(), big.data(), 10), 0);
  EXPECT_EQ(got[12], std::byte{0});
  EXPECT_EQ(std::memcmp(got.data() + 15, big.data() + 10, big.size() - 10), 0);
  {
    io::AtomicFileWriter out(path);
    out.write(big);
  }  // abandoned: the committed file is untouched
  EXPECT_EQ(file_bytes(path).size(), big.size() + 5);
  std::filesystem::remove(path);
}

}  // namespace
}  // namespace qkv::test
