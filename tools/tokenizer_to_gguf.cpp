// A Hugging Face tokenizer (tokenizer.json + tokenizer_config.json) → a GGUF file holding its tokenizer.ggml.*
// metadata as llama.cpp's convert_hf_to_gguf.py writes it, plus the few llama hyper-parameters llama.cpp needs to load
// a file vocab-only (no tensors). For checking qkv's GGUF tokenizer (HfTokenizer::from_gguf) and llama.cpp's against
// the tokenizer.json without downloading a GGUF (tests/tokenizer_cases_vs_hf.sh). A developer tool, not part of qkv.
//   qkv_tokenizer_to_gguf MODEL_DIR OUT.gguf
// What convert_hf_to_gguf.py does, and what this does alike: qkv::text::gguf_tokenizer_metadata (src/text/gguf_vocab.cpp),
// which qkv quantize uses for the GGUF files it writes.
#include <cstdio>
#include <string>

#include "qkv/core/error.hpp"
#include "qkv/io/gguf.hpp"
#include "qkv/text/gguf_vocab.hpp"

using qkv::io::GgufValue;

// convert_hf_to_gguf.py's check text's hash, to show the SHA-256 is the one convert computes.
constexpr const char* kChkTxt =
    "\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ (multiple emojis concatenated) ✅ 🦙🦙 3 33 333 "
    "3333 33333 333333 3333333 33333333 3.3 3..3 3...3 កាន់តែពិសេសអាច😁 ?我想在apple工作1314151天～ ------======= нещо на "
    "Български ''''''```````\"\"\"\"......!!!!!!?????? I've been 'told he's there, 'RE you sure? 'M not sure I'll make it, "
    "'D you like some tea? We'Ve a'lL";

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: qkv_tokenizer_to_gguf MODEL_DIR OUT.gguf\n");
    return 2;
  }
  try {
    if (qkv::text::sha256_hex(kChkTxt) != "a36179c1e2b1cfcfbfad1dc779addad2ffc778201e4cf0d538bddeafa2c526da")
      throw std::runtime_error("the test text or SHA-256 is not convert_hf_to_gguf.py's");
    auto meta = qkv::text::gguf_tokenizer_metadata(argv[1]);
    std::string model, pre;
    size_t tokens = 0, merges = 0;
    for (const auto& [k, v] : meta) {
      if (k == "tokenizer.ggml.model") model = v.as_string();
      if (k == "tokenizer.ggml.pre") pre = v.as_string();
      if (k == "tokenizer.ggml.tokens") tokens = v.size();
      if (k == "tokenizer.ggml.merges") merges = v.size();
    }
    if (model == "gpt2") std::printf("tokenizer.ggml.pre = %s\n", pre.c_str());
    // The hyper-parameters llama.cpp reads before the vocabulary (the file has no tensors: load it vocab-only).
    qkv::io::GgufWriter out(argv[2]);
    for (auto& [k, v] : std::vector<std::pair<std::string, GgufValue>>{
             {"general.architecture", GgufValue::string("llama")}, {"general.name", GgufValue::string("tokenizer only")},
             {"llama.context_length", GgufValue::u32(4096)}, {"llama.embedding_length", GgufValue::u32(64)},
             {"llama.block_count", GgufValue::u32(1)}, {"llama.feed_forward_length", GgufValue::u32(128)},
             {"llama.attention.head_count", GgufValue::u32(1)}, {"llama.attention.layer_norm_rms_epsilon", GgufValue::f32(1e-5f)},
             {"llama.vocab_size", GgufValue::u32(static_cast<uint32_t>(tokens))}})
      out.add_metadata(k, std::move(v));
    for (auto& [k, v] : meta) out.add_metadata(k, std::move(v));
    out.finish();
    std::printf("%s: %s tokenizer, %zu tokens, %zu merges\n", argv[2], model.c_str(), tokens, merges);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "qkv_tokenizer_to_gguf: %s\n", e.what());
    return 1;
  }
}
