// Makes a tiny random Hugging Face folder around a real tokenizer, for the tests that run docs/api.md's examples on a
// folder as a user has one (config.json, safetensors, tokenizer.json, tokenizer_config.json with its chat template).
//   make_tiny_folder MODEL_TYPE TOKENIZER_DIR OUT_DIR
#include <filesystem>
#include <iostream>
#include <string>

#include "qkv/core/error.hpp"
#include "qkv/core/random.hpp"
#include "qkv/nn/hf.hpp"
#include "qkv/text/hf_tokenizer.hpp"

int main(int argc, char** argv) {
  if (argc != 4) {
    std::cerr << "usage: make_tiny_folder MODEL_TYPE TOKENIZER_DIR OUT_DIR\n";
    return 2;
  }
  namespace fs = std::filesystem;
  const std::string type = argv[1];
  const fs::path tokenizer_dir = argv[2], out = argv[3];
  try {
    const auto tokenizer = qkv::text::HfTokenizer::load((tokenizer_dir / "tokenizer.json").string(),
                                                        (tokenizer_dir / "tokenizer_config.json").string());
    const std::string json = R"({"model_type": ")" + type + R"(", "vocab_size": )" +
                             std::to_string(tokenizer->vocab_size()) + R"(, "hidden_size": 32, "intermediate_size": 64,
      "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
      "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "tie_word_embeddings": true})";
    qkv::Generator gen(11);
    qkv::nn::Decoder model(qkv::nn::decoder_config_from_hf(json), gen);
    qkv::nn::save_hf_folder(out.string(), model);
    for (const char* file : {"tokenizer.json", "tokenizer_config.json"})
      fs::copy_file(tokenizer_dir / file, out / file, fs::copy_options::overwrite_existing);
    std::cout << "made " << out.string() << ": " << type << ", vocabulary " << tokenizer->vocab_size() << "\n";
  } catch (const std::exception& e) {
    std::cerr << "make_tiny_folder: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
