// PyTorch .pth files: the restricted unpickler against torch.save's own output (tools/pth_reference.py), hostile
// files refused, and the writer read back.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "helpers.hpp"
#include "qkv/kernels/convert.hpp"
#include "qkv/io/pth.hpp"

namespace qkv::test {
namespace {

std::string pth(const std::string& name) { return fixture("pth/" + name); }

// Same shape (a 0-dimensional tensor and a 1-element one count as equal: safetensors readers differ) and bits.
bool bit_equal(const Tensor& a, const Tensor& b) {
  const bool scalars = a.numel() == 1 && b.numel() == 1 && (a.shape().rank() == 0 || b.shape().rank() == 0);
  return (scalars || a.shape() == b.shape()) && (a.numel() == 0 || std::memcmp(a.data(), b.data(), a.numel() * sizeof(float)) == 0);
}

TEST(Pth, ReadsTorchSaveStateDictBitForBit) {
  const io::PthFile file = io::PthFile::open(pth("model.pth"));
  const io::SafetensorsFile expected = io::SafetensorsFile::open(pth("expected.safetensors"));
  const io::PyRef root = file.root();
  ASSERT_TRUE(root.is(io::PyKind::Dict));
  size_t n = 0;
  for (const auto& [key, value] : root.items()) {
    const std::string name = key.as_string();
    ASSERT_TRUE(expected.contains("state." + name)) << name;
    EXPECT_TRUE(bit_equal(file.weights(value), expected.tensor("state." + name))) << name;
    ++n;
  }
  EXPECT_EQ(n, 2u + 2u * 14u + 3u);  // embeddings, 2 blocks of 14 (the causal mask included), final norm, head
  EXPECT_NE(root.describe().find("OrderedDict"), std::string::npos);
}

TEST(Pth, ReadsHalfAndBFloat16Storages) {
  const io::PthFile reference = io::PthFile::open(pth("model.pth"));
  for (const char* name : {"model_half.pth", "model_bf16.pth"}) {
    const io::PthFile file = io::PthFile::open(pth(name));
    const bool half = std::string(name) == "model_half.pth";
    for (const auto& [key, value] : file.root().items()) {
      EXPECT_EQ(value.as_tensor().dtype, half ? io::DType::F16 : io::DType::BF16);
      const Tensor got = file.weights(value);
      const Tensor full = reference.weights(*reference.root().get(key.as_string()));
      // Rounded to 11 (half) or 8 (bfloat16) significant bits, then widened exactly.
      EXPECT_TRUE(all_close(got, full, half ? 1.0 / 1024 : 1.0 / 128, half ? 1e-4 : 0.0)) << name << " " << key.as_string();
    }
  }
}

TEST(Pth, ViewsOffsetsStridesAndSharedStorages) {
  const io::PthFile file = io::PthFile::open(pth("views.pth"));
  const io::SafetensorsFile expected = io::SafetensorsFile::open(pth("views.expected.safetensors"));
  for (const char* name : {"base", "rows", "strided", "transposed", "element", "half_view"}) {
    const io::PyRef ref = *file.root().get(name);
    EXPECT_TRUE(bit_equal(file.weights(ref), expected.tensor(name))) << name;
    // read_weights: the same values straight into a tensor (row-major storages in chunks, views gathered), and into
    // a bf16 tensor each rounded to nearest even.
    const Tensor want = file.weights(ref);  // the expected values, checked above
    Tensor into = Tensor::empty(want.shape()), half = Tensor::empty(want.shape());
    file.read_weights(ref, into);
    EXPECT_TRUE(bit_equal(into, want)) << name;
    half.to_bf16_(false);
    file.read_weights(ref, half);
    for (int64_t i = 0; i < want.numel(); ++i)
      EXPECT_EQ(half.bf16()[i], kernels::f32_to_bf16_reference(want.data()[i])) << name << "[" << i << "]";
  }
  Tensor wrong = Tensor::empty({7});
  EXPECT_THROW(file.read_weights(*file.root().get("base"), wrong), ShapeError);
  // rows, strided, transposed and element view base's storage: one key, different offsets and strides.
  const io::PthTensor& rows = file.root().get("rows")->as_tensor();
  const io::PthTensor& transposed = file.root().get("transposed")->as_tensor();
  EXPECT_EQ(rows.storage, file.root().get("base")->as_tensor().storage);
  EXPECT_EQ(rows.offset, 6);
  EXPECT_EQ(transposed.stride, (std::vector<int64_t>{1, 6}));
  EXPECT_EQ(file.root().get("element")->as_tensor().shape.size(), 0u);
}

TEST(Pth, ReadsTheBooksModelAndOptimizerFile) {
  const io::PthFile file = io::PthFile::open(pth("model_and_optimizer.pth"));
  const io::PyRef optimizer = *file.root().get("optimizer_state_dict");
  const io::PyRef group = (*optimizer.get("param_groups"))[0];
  EXPECT_DOUBLE_EQ(group.get("lr")->as_number(), 4e-4);
  EXPECT_DOUBLE_EQ(group.get("weight_decay")->as_number(), 0.1);
  EXPECT_DOUBLE_EQ((*group.get("betas"))[1].as_number(), 0.999);
  EXPECT_FALSE(group.get("amsgrad")->as_bool());
  const io::PyRef state0 = *optimizer.get("state")->get(int64_t{0});
  EXPECT_EQ(file.int64s(*state0.get("step")), std::vector<int64_t>{3});
  // A wrong kind is named with where it is.
  try {
    (void)group.get("lr")->as_string();
    FAIL();
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find("optimizer_state_dict.param_groups[0].lr is the float"), std::string::npos) << e.what();
  }
}

TEST(Pth, RefusesEveryHostileFileNamingTheProblem) {
  std::ifstream in(pth("hostile/expected.json"));
  const nlohmann::json expected = nlohmann::json::parse(in);
  ASSERT_GE(expected.size(), 20u);
  std::filesystem::remove("/tmp/qkv-pwned");
  for (const auto& [name, words] : expected.items()) {
    try {
      const io::PthFile file = io::PthFile::open(pth("hostile/" + name));
      // Files whose problem is only in the data are refused when it is read.
      for (const auto& [key, value] : file.root().items()) (void)file.weights(value);
      ADD_FAILURE() << name << " was accepted";
    } catch (const IoError& e) {
      const std::string message = e.what();
      EXPECT_NE(message.find(pth("hostile/" + name)), std::string::npos) << message;
      for (const auto& w : words) EXPECT_NE(message.find(w.get<std::string>()), std::string::npos) << name << ": " << message;
    }
  }
  EXPECT_FALSE(std::filesystem::exists("/tmp/qkv-pwned"));  // nothing ran
}

TEST(Pth, FromRecordsChecksStoragesBeforeReading) {
  // A pickle of {"w": tensor viewing storage "0"} with the storage present but shorter than it says.
  auto text = [](const std::string& v) {  // BINUNICODE
    const uint32_t n = static_cast<uint32_t>(v.size());
    return "X" + std::string(reinterpret_cast<const char*>(&n), 4) + v;
  };
  const std::string pickle = std::string("\x80\x02}(") + text("w") + "ctorch._utils\n_rebuild_tensor_v2\n((" +
                             text("storage") + "ctorch\nFloatStorage\n" + text("0") + text("cpu") +
                             std::string("K\x04tQK\x00K\x04\x85K\x01\x85\x89" "ccollections\nOrderedDict\n)RtRu.", 44);
  std::vector<std::byte> code(pickle.size());
  std::memcpy(code.data(), pickle.data(), code.size());
  std::map<std::string, std::vector<std::byte>> records{{"data.pkl", code}, {"data/0", std::vector<std::byte>(16)}};
  const io::PthFile ok = io::PthFile::from_records(records);
  EXPECT_TRUE(bit_equal(ok.weights(*ok.root().get("w")), Tensor::zeros({4})));
  records["data/0"].resize(12);
  EXPECT_THROW(io::PthFile::from_records(records), IoError);
}

TEST(Pth, WriterRoundTrip) {
  const std::string path = ::testing::TempDir() + "qkv_roundtrip.pth";
  io::PyValue root = io::PyValue::dict();
  io::PyValue& sd = root.set(io::PyValue::of("model_state_dict"), io::PyValue::dict(/*ordered=*/true));
  const Tensor w = random_tensor({3, 5}, 1);
  sd.set(io::PyValue::of("w"), io::PyValue::of(io::TensorData::from_tensor("", w)));
  sd.set(io::PyValue::of("scalar"), io::PyValue::of(io::TensorData::from_tensor("", Tensor::scalar(2.5f))));
  const std::vector<int64_t> ids{1, -2, int64_t{1} << 40};
  sd.set(io::PyValue::of("ids"), io::PyValue::of(io::TensorData::from_int64s("", ids)));
  io::PyValue& misc = root.set(io::PyValue::of("misc"), io::PyValue::dict());
  misc.set(io::PyValue::of(int64_t{7}), io::PyValue::tuple({io::PyValue::of(0.9), io::PyValue::of(0.999)}));
  misc.set(io::PyValue::of("list"), io::PyValue::list({io::PyValue::of(int64_t{-70000}), io::PyValue::of(int64_t{1} << 50),
                                                       io::PyValue::none(), io::PyValue::of(true), io::PyValue::of("é")}));
  io::save_pth(path, root);
  const io::PthFile file = io::PthFile::open(path);
  EXPECT_TRUE(bit_equal(file.weights(*file.root().get("model_state_dict")->get("w")), w));
  EXPECT_EQ(file.root().get("model_state_dict")->get("scalar")->as_tensor().shape.size(), 0u);
  EXPECT_EQ(file.int64s(*file.root().get("model_state_dict")->get("ids")), ids);
  const io::PyRef m = *file.root().get("misc");
  EXPECT_DOUBLE_EQ((*m.get(int64_t{7}))[1].as_number(), 0.999);
  const io::PyRef list = *m.get("list");
  EXPECT_EQ(list[0].as_int(), -70000);
  EXPECT_EQ(list[1].as_int(), int64_t{1} << 50);
  EXPECT_TRUE(list[2].is(io::PyKind::None));
  EXPECT_TRUE(list[3].as_bool());
  EXPECT_EQ(list[4].as_string(), "é");
}

}  // namespace
}  // namespace qkv::test
