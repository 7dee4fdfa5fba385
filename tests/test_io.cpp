// safetensors and .npy: round trips, files written by PyTorch, and hand-made bad files that must each get a
// clear error (never a crash or a read outside the buffer; the ASan build checks the latter).
#include <cstring>
#include <filesystem>
#include <fstream>

#include "helpers.hpp"
#include "qkv/io/file.hpp"
#include "qkv/io/npy.hpp"
#include "qkv/io/safetensors.hpp"

namespace qkv::test {
namespace {

std::filesystem::path scratch(const std::string& name) { return std::filesystem::temp_directory_path() / ("qkv_io_" + name); }

std::vector<std::byte> bytes_of(const std::string& s) {
  std::vector<std::byte> out(s.size());
  std::memcpy(out.data(), s.data(), s.size());
  return out;
}

// A safetensors file from a header text and a data buffer of `data_size` zero bytes.
std::vector<std::byte> safetensors_bytes(const std::string& header, size_t data_size, int64_t length_override = -1) {
  std::string file(8, '\0');
  const uint64_t length = length_override >= 0 ? static_cast<uint64_t>(length_override) : header.size();
  std::memcpy(file.data(), &length, 8);
  file += header;
  file.append(data_size, '\0');
  return bytes_of(file);
}

void expect_error(const std::vector<std::byte>& file, const std::string& fragment) {
  try {
    io::SafetensorsFile::parse(file, "bad.safetensors");
    ADD_FAILURE() << "accepted a file that should fail with: " << fragment;
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
    EXPECT_EQ(std::string(e.what()).rfind("bad.safetensors: ", 0), 0u) << e.what();
  }
}

TEST(Safetensors, RoundTripKeepsNamesOrderShapesAndMetadata) {
  const Tensor a = random_tensor({2, 3}, 1), b = random_tensor({4}, 2), s = Tensor::scalar(3.5f);
  const auto path = scratch("roundtrip.safetensors").string();
  io::save_safetensors(path, {{"b", b}, {"a", a}, {"s", s}}, {{"module", "X"}, {"d_in", "3"}});
  const auto file = io::SafetensorsFile::open(path);
  EXPECT_EQ(file.metadata().at("module"), "X");
  EXPECT_TRUE(all_close(file.tensor("a"), a, 0, 0));
  EXPECT_TRUE(all_close(file.tensor("b"), b, 0, 0));
  EXPECT_EQ(file.tensor("s").rank(), 0);
  EXPECT_EQ(file.tensors()[0].name, "b");
  EXPECT_THROW(file.tensor("missing"), IoError);
  std::filesystem::remove(path);
}

TEST(Safetensors, ReadsHalfBFloatDoubleAndIntegers) {
  // F16 1.0 = 0x3c00, −2.0 = 0xc000, 2⁻²⁴ (smallest subnormal) = 0x0001; BF16 1.5 = 0x3fc0.
  std::string data;
  auto put16 = [&](uint16_t v) { data.append(reinterpret_cast<const char*>(&v), 2); };
  put16(0x3c00), put16(0xc000), put16(0x0001), put16(0x3fc0);
  const double d = -0.25;
  data.append(reinterpret_cast<const char*>(&d), 8);
  const int64_t i64 = -7;
  const int32_t i32 = 9;
  data.append(reinterpret_cast<const char*>(&i64), 8);
  data.append(reinterpret_cast<const char*>(&i32), 4);
  const std::string header =
      R"({"h":{"dtype":"F16","shape":[3],"data_offsets":[0,6]},"b":{"dtype":"BF16","shape":[1],"data_offsets":[6,8]},)"
      R"("d":{"dtype":"F64","shape":[1],"data_offsets":[8,16]},"l":{"dtype":"I64","shape":[1],"data_offsets":[16,24]},)"
      R"("i":{"dtype":"I32","shape":[1],"data_offsets":[24,28]}})";
  std::vector<std::byte> file = safetensors_bytes(header, 0);
  const auto* p = reinterpret_cast<const std::byte*>(data.data());
  file.insert(file.end(), p, p + data.size());
  const auto st = io::SafetensorsFile::parse(file);
  EXPECT_EQ(st.tensor("h").to_vector(), (std::vector<float>{1.0f, -2.0f, std::ldexp(1.0f, -24)}));
  EXPECT_EQ(st.tensor("b").item(), 1.5f);
  EXPECT_EQ(st.tensor("d").item(), -0.25f);
  EXPECT_EQ(st.int64s("l"), (std::vector<int64_t>{-7}));
  EXPECT_EQ(st.tensor("i").item(), 9.0f);
}

TEST(Safetensors, LoadsAStateDictWrittenFromPyTorch) {
  // tools/torch_reference.py wrote this from torch's MultiHeadAttention.state_dict(), mask buffer included.
  const auto file = io::SafetensorsFile::open(fixture("modules/mha_book.module.safetensors"));
  manual_seed(0);
  nn::MultiHeadAttention mha(3, 2, 6, 0.0, 2);
  nn::StateDict state;
  for (const auto& info : file.tensors()) state.insert(info.name, file.tensor(info.name));
  ASSERT_NE(state.find("mask"), nullptr);
  mha.load_state_dict(state);
  EXPECT_TRUE(all_close(mha.out_proj.bias, file.tensor("out_proj.bias"), 0, 0));
}

TEST(Safetensors, BadFilesGetClearErrors) {
  const std::string one = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  expect_error({}, "too small");                                                         // empty file
  expect_error(bytes_of("abc"), "too small");                                            // truncated length
  expect_error(safetensors_bytes(one, 8, 1'000'000'000), "100 MB");                      // huge header length
  expect_error(safetensors_bytes(one, 0, static_cast<int64_t>(one.size()) + 50), "truncated");  // header past the end
  expect_error(safetensors_bytes(one, 4), "truncated");                                  // data cut short
  expect_error(safetensors_bytes(one, 12), "4 trailing bytes");                          // trailing bytes
  expect_error(safetensors_bytes(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                                 R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})", 12), "overlaps");
  expect_error(safetensors_bytes(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                                 R"("b":{"dtype":"F32","shape":[1],"data_offsets":[12,16]}})", 16), "hole of 4 bytes");
  expect_error(safetensors_bytes(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8), "does not match");
  expect_error(safetensors_bytes(R"({"a":{"dtype":"F32","shape":[4294967296,4294967296,16],"data_offsets":[0,8]}})", 8),
               "overflows");
  expect_error(safetensors_bytes(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                                 R"("a":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})", 16), "twice");
  expect_error(safetensors_bytes(R"({"__metadata__":{"n":3}})", 0), "not a string");
  expect_error(safetensors_bytes(R"({"__metadata__":[1]})", 0), "__metadata__ must be an object");
  expect_error(safetensors_bytes(R"({"a":{"dtype":"F32","shape":[2],)", 8), "not valid UTF-8 JSON");  // invalid JSON
  expect_error(safetensors_bytes("{\"a\xff\":{}}", 0), "not valid UTF-8 JSON");          // not UTF-8
  expect_error(safetensors_bytes(R"([1,2])", 0), "JSON object");
  expect_error(safetensors_bytes(R"({"a":{"dtype":"Q8","shape":[2],"data_offsets":[0,8]}})", 8), "unknown dtype 'Q8'");
  expect_error(safetensors_bytes(R"({"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", 8), "non-negative");
  expect_error(safetensors_bytes(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})", 8), "end before");
  expect_error(safetensors_bytes(R"({"a":{"dtype":"F32","shape":[2]}})", 8), "data_offsets");
  expect_error(safetensors_bytes(R"({"a":{"shape":[2],"data_offsets":[0,8]}})", 8), "missing dtype");
  expect_error(safetensors_bytes(R"({"a":3})", 0), "entry must be an object");
  // A five-dimensional tensor parses but cannot become a qkv Tensor.
  const auto five = io::SafetensorsFile::parse(
      safetensors_bytes(R"({"a":{"dtype":"F32","shape":[1,1,1,1,2],"data_offsets":[0,8]}})", 8), "five.safetensors");
  EXPECT_THROW(five.tensor("a"), IoError);
}

TEST(Safetensors, AtomicWriteLeavesTheOldFileWhenTheDirectoryIsGone) {
  const auto path = (scratch("missing_dir") / "x.safetensors").string();
  EXPECT_THROW(io::save_safetensors(path, std::vector<std::pair<std::string, Tensor>>{{"a", Tensor::zeros({1})}}), IoError);
}

std::vector<std::byte> npy_bytes(const std::string& dict, size_t data_size, int major = 1) {
  std::string file = "\x93NUMPY";
  file += static_cast<char>(major);
  file += '\0';
  if (major == 1) {
    file += static_cast<char>(dict.size() & 0xff);
    file += static_cast<char>(dict.size() >> 8);
  } else {
    const uint32_t n = static_cast<uint32_t>(dict.size());
    file.append(reinterpret_cast<const char*>(&n), 4);
  }
  file += dict;
  file.append(data_size, '\0');
  return bytes_of(file);
}

void expect_npy_error(const std::vector<std::byte>& file, const std::string& fragment) {
  try {
    io::parse_npy(file, "bad.npy");
    ADD_FAILURE() << "accepted a file that should fail with: " << fragment;
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
  }
}

TEST(Npy, RoundTripAndVersions) {
  const Tensor t = random_tensor({3, 5}, 7);
  const auto path = scratch("t.npy").string();
  io::save_npy(path, t);
  EXPECT_TRUE(all_close(io::load_npy(path), t, 0, 0));
  std::filesystem::remove(path);
  const std::string dict = "{'descr': '<i8', 'fortran_order': False, 'shape': (2,), }";
  for (int major : {1, 2, 3}) {
    auto file = npy_bytes(dict, 0, major);
    const int64_t values[] = {-3, 40};
    const auto* p = reinterpret_cast<const std::byte*>(values);
    file.insert(file.end(), p, p + 16);
    EXPECT_EQ(io::parse_npy(file).to_vector(), (std::vector<float>{-3.0f, 40.0f})) << "version " << major;
  }
  auto f8 = npy_bytes("{'descr': '<f8', 'fortran_order': False, 'shape': (), }", 0);
  const double half = 0.5;
  f8.insert(f8.end(), reinterpret_cast<const std::byte*>(&half), reinterpret_cast<const std::byte*>(&half) + 8);
  EXPECT_EQ(io::parse_npy(f8).item(), 0.5f);
}

TEST(Npy, BadFilesGetClearErrors) {
  const std::string good = "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }";
  expect_npy_error(bytes_of("NOTNUMPY12345"), "bad magic");
  expect_npy_error(npy_bytes(good, 24, 4), "unsupported .npy version 4");
  expect_npy_error(npy_bytes("{'descr': '<f4', 'shape': (2, 3), }", 24), "must have");
  expect_npy_error(npy_bytes("{'descr': '<f4', 'fortran_order': Maybe, 'shape': (2,), }", 8), "True or False");
  expect_npy_error(npy_bytes("{'descr': '<f4', 'fortran_order': False, 'shape': (2, x), }", 8), "non-negative integers");
  expect_npy_error(npy_bytes("{'descr': '<f4', 'fortran_order': False, 'shape': (2,", 8), "ends early");
  expect_npy_error(npy_bytes("{'descr': '<f4', 'fortran_order': False, 'shape': (2,), 'x': 1}", 8), "unknown key");
  expect_npy_error(npy_bytes("{'descr': '<f4', 'fortran_order': True, 'shape': (2, 3), }", 24), "Fortran-order");
  expect_npy_error(npy_bytes("{'descr': '>f4', 'fortran_order': False, 'shape': (2,), }", 8), "unsupported dtype '>f4'");
  expect_npy_error(npy_bytes(good, 20), "truncated");
  expect_npy_error(npy_bytes(good, 28), "trailing bytes");
  expect_npy_error(npy_bytes("{'descr': '<f4', 'fortran_order': False, 'shape': (99999999999999999999,), }", 8),
                   "too large");
  auto cut = npy_bytes(good, 24);
  cut.resize(15);
  expect_npy_error(cut, "past the end");
  EXPECT_THROW(io::load_npy("/nonexistent.npy"), IoError);
}

// A file that is not what was expected is named for what it is, from its first bytes.
TEST(Sniff, NamesTextGgufArchivesFoldersAndWhatItCannotTell) {
  struct Case {
    std::string bytes;
    io::FileKind kind;
    std::string description;
  };
  const std::string header = R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})";
  std::string safetensors(8, '\0');
  safetensors[0] = static_cast<char>(header.size());
  safetensors += header + std::string(4, '\0');
  for (const Case& c : std::vector<Case>{
           {"", io::FileKind::Empty, "an empty file"},
           {"\n\n  In the beginning God created the heaven and the earth.\n", io::FileKind::Text,
            "UTF-8 text (\"In the beginning God created the heaven ...\")"},
           {"Tokyo \xe6\x9d\xb1\xe4\xba\xac", io::FileKind::Text, "UTF-8 text (\"Tokyo \\xe6"},
           {" {\"model_type\": \"llama\"}", io::FileKind::Json, "JSON text"},
           {std::string("GGUF\x03\0\0\0", 8) + "rest", io::FileKind::Gguf, "a GGUF file (version 3, llama.cpp's format)"},
           {safetensors, io::FileKind::Safetensors, "a safetensors file"},
           {"PK\x03\x04" "data.pkl", io::FileKind::Zip, "a zip archive"},
           {"\x80\x02}q\x00", io::FileKind::Pickle, "a Python pickle (protocol 2)"},
           {"\x93NUMPY\x01\x00", io::FileKind::Npy, "a NumPy .npy array"},
           {"\x1f\x8b\x08", io::FileKind::Gzip, "gzip-compressed data"},
           {"valid \xff\xfe bytes", io::FileKind::Binary, "binary data of no format qkv knows (it starts 76 61 6c 69)"},
           {std::string("\0\x01\x02\x03", 4), io::FileKind::Binary, "it starts 00 01 02 03"}}) {
    const io::FileFormat got = io::sniff_bytes(bytes_of(c.bytes), c.bytes.size());
    EXPECT_EQ(got.kind, c.kind) << c.bytes;
    EXPECT_NE(got.description.find(c.description), std::string::npos) << got.description;
  }
  // A safetensors-like start whose header cannot fit the file is not called safetensors.
  EXPECT_NE(io::sniff_bytes(bytes_of(safetensors.substr(0, 20)), 20).kind, io::FileKind::Safetensors);
  // From a path: missing, a folder (its names listed), a file.
  const auto dir = scratch("sniff_folder");
  std::filesystem::remove_all(dir);
  EXPECT_EQ(io::sniff_format(dir.string()).kind, io::FileKind::Missing);
  std::filesystem::create_directories(dir);
  EXPECT_EQ(io::describe_file(dir.string()), "an empty folder");
  for (const char* f : {"tokenizer.json", "model.safetensors"}) std::ofstream(dir / f) << "{}";
  EXPECT_EQ(io::describe_file(dir.string()), "a folder holding model.safetensors and tokenizer.json");
  EXPECT_EQ(io::sniff_format((dir / "tokenizer.json").string()).kind, io::FileKind::Json);
  EXPECT_EQ(io::sniff_format("/dev/null").kind, io::FileKind::Special);
  std::filesystem::remove_all(dir);
  // The safetensors reader names text for what it is instead of reporting a huge header length alone.
  expect_error(bytes_of("In the beginning God created the heaven and the earth."),
               "the file is UTF-8 text (\"In the beginning");
}

}  // namespace
}  // namespace qkv::test
