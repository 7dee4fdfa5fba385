// The tokenizer.ggml.* metadata of a Hugging Face tokenizer (see qkv/text/gguf_vocab.hpp), as convert_hf_to_gguf.py
// (conversion/base.py, gguf-py/gguf/vocab.py) writes it:
// - byte-level BPE (not byte_fallback): _set_vocab_gpt2. Tokens by id ([PADi] of type UNUSED in gaps); an added token
//   is CONTROL if special or if it looks special (<|…|>, <｜…｜>, <unused…>, <pad>, <mask>), else USER_DEFINED with ▁
//   written as a space; a non-normalized one is first encoded and decoded by the tokenizer. tokenizer.ggml.pre is
//   named from the sha256 of str(tokenizer.encode(chktxt)), looked up in convert's table — or, for a tokenizer not in
//   it (a small one made for a test), from its Split regexes, which is what that name stands for in llama.cpp; the
//   merges are the file's ("a b"; a pair ["a", "b"] is joined with a space, a space inside written U+0120).
// - SentencePiece BPE (byte_fallback, a Sequence decoder: Llama 2, Mistral, Gemma): _create_vocab_sentencepiece, as
//   if tokenizer.model were there. Its piece scores are rebuilt from the merges (SentencePiece's BPE scores a piece
//   −(the order it was learnt in); tokenizers' merges list the pieces in that order): a piece's score is −(the rank of
//   the first merge that makes it). add_space_prefix is what the tokenizer.json does (a Prepend ▁ normalizer).
// - SpecialVocab: bos/eos/unk/sep/pad/cls/mask ids from tokenizer_config.json's *_token found among the added tokens;
//   add_bos/add_eos from a TemplateProcessing post-processor, then from the config's add_*_token; the chat template.
#include "qkv/text/gguf_vocab.hpp"

#include <cstdio>
#include <filesystem>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "hf_pipeline.hpp"
#include "qkv/core/error.hpp"
#include "qkv/text/hf_tokenizer.hpp"
#include "qkv/text/records.hpp"

namespace qkv::text {

using io::GgufValue;

// ---- SHA-256 (FIPS 180-4) ----
std::string sha256_hex(const std::string& message) {
  static const uint32_t k[64] = {
      0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5, 0xd807aa98, 0x12835b01,
      0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174, 0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc,
      0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da, 0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147,
      0x06ca6351, 0x14292967, 0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
      0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070, 0x19a4c116, 0x1e376c08,
      0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3, 0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208,
      0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};
  uint32_t h[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
  std::string m = message;
  const uint64_t bits = static_cast<uint64_t>(message.size()) * 8;
  m += static_cast<char>(0x80);
  while (m.size() % 64 != 56) m += '\0';
  for (int i = 7; i >= 0; --i) m += static_cast<char>((bits >> (8 * i)) & 0xFF);
  auto rotr = [](uint32_t x, int n) { return (x >> n) | (x << (32 - n)); };
  for (size_t block = 0; block < m.size(); block += 64) {
    uint32_t w[64];
    for (int i = 0; i < 16; ++i) {
      w[i] = 0;
      for (int b = 0; b < 4; ++b) w[i] = (w[i] << 8) | static_cast<unsigned char>(m[block + 4 * i + b]);
    }
    for (int i = 16; i < 64; ++i) {
      const uint32_t s0 = rotr(w[i - 15], 7) ^ rotr(w[i - 15], 18) ^ (w[i - 15] >> 3);
      const uint32_t s1 = rotr(w[i - 2], 17) ^ rotr(w[i - 2], 19) ^ (w[i - 2] >> 10);
      w[i] = w[i - 16] + s0 + w[i - 7] + s1;
    }
    uint32_t a = h[0], b = h[1], c = h[2], d = h[3], e = h[4], f = h[5], g = h[6], hh = h[7];
    for (int i = 0; i < 64; ++i) {
      const uint32_t t1 = hh + (rotr(e, 6) ^ rotr(e, 11) ^ rotr(e, 25)) + ((e & f) ^ (~e & g)) + k[i] + w[i];
      const uint32_t t2 = (rotr(a, 2) ^ rotr(a, 13) ^ rotr(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
      hh = g, g = f, f = e, e = d + t1, d = c, c = b, b = a, a = t1 + t2;
    }
    h[0] += a, h[1] += b, h[2] += c, h[3] += d, h[4] += e, h[5] += f, h[6] += g, h[7] += hh;
  }
  char out[65];
  for (int i = 0; i < 8; ++i) std::snprintf(out + 8 * i, 9, "%08x", h[i]);
  return out;
}

namespace {

using json = nlohmann::json;

// convert_hf_to_gguf.py's get_vocab_base_pre: its test text, and the hashes of the tokenizers qkv meets.
constexpr const char* kChkTxt =
    "\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ (multiple emojis concatenated) ✅ 🦙🦙 3 33 333 "
    "3333 33333 333333 3333333 33333333 3.3 3..3 3...3 កាន់តែពិសេសអាច😁 ?我想在apple工作1314151天～ ------======= нещо на "
    "Български ''''''```````\"\"\"\"......!!!!!!?????? I've been 'told he's there, 'RE you sure? 'M not sure I'll make it, "
    "'D you like some tea? We'Ve a'lL";
const std::map<std::string, std::string>& pre_by_hash() {
  static const std::map<std::string, std::string> table = {
      {"0ef9807a4087ebef797fc749390439009c3b9eda9ad1a097abbe738f486c01e5", "llama-bpe"},
      {"c136ed14d01c2745d4f60a9596ae66800e2b61fa45643e72436041855ad4089d", "smaug-bpe"},  // Llama 3's without its BOS
      {"d4540891389ea895b53b399da6ac824becc30f2fba0e9ddbb98f92e55ca0e97c", "qwen2"},
      {"e636dc30a262dcc0d8c323492e32ae2b70728f4df7dfe9737d9f920a282b8aea", "qwen2"},
      {"877081d19cf6996e2c4ff0e1236341e9b7bde288f5311a56a937f0afbbb3aeb5", "deepseek-v3"},
      {"b3f499bb4255f8ca19fccd664443283318f2fd2414d5e0b040fbdd0cc195d6c5", "deepseek-r1-qwen"},
      {"ccc2ef013c104be7bae2965776d611e1d7a8a2a9c547dd93a682c9a9fc80352e", "gpt-4o"},
      {"3ce83efda5659b07b1ad37ca97ca5797ea4285d9b9ab0dc679e4a720c9da7454", "gpt-2"},
      {"0fe1cf6eda062318a1af7270f3331a85c539a01778ff948e24388e949c5282f4", "gpt-2"},
  };
  return table;
}

// Python's str() of a list of ints: "[1, 2, 3]".
std::string python_list(const std::vector<int64_t>& ids) {
  std::string s = "[";
  for (size_t i = 0; i < ids.size(); ++i) s += (i ? ", " : "") + std::to_string(ids[i]);
  return s + "]";
}

bool looks_special(const std::string& t) {
  auto ends = [&](const std::string& b, const std::string& e) {
    return t.size() >= b.size() + e.size() && t.compare(0, b.size(), b) == 0 && t.compare(t.size() - e.size(), e.size(), e) == 0;
  };
  return t == "<pad>" || t == "<mask>" || t == "<2mass>" || t == "[@BOS@]" || ends("<|", "|>") || ends("<｜", "｜>") ||
         ends("<unused", ">");
}

std::string replace_all(std::string s, const std::string& from, const std::string& to) {
  for (size_t at = 0; (at = s.find(from, at)) != std::string::npos; at += to.size()) s.replace(at, from.size(), to);
  return s;
}

// A JSON file of the folder, or null when it is absent; IoError when it is not JSON.
json read_json(const std::filesystem::path& path) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec)) return nullptr;
  try {
    return json::parse(read_text_file(path.string(), int64_t{1} << 30));
  } catch (const json::exception& e) {
    throw IoError(path.string() + ": not valid JSON (" + e.what() + ")");
  }
}

std::string token_text(const json& v) {
  if (v.is_string()) return v.get<std::string>();
  if (v.is_object() && v.contains("content") && v["content"].is_string()) return v["content"];
  return "";
}

enum TokenType : int32_t { kNormal = 1, kUnknown = 2, kControl = 3, kUserDefined = 4, kUnused = 5, kByte = 6 };

// The Split regexes of a byte-level pre-tokenizer, in order (ByteLevel with use_regex: GPT-2's), for naming it when
// its hash is not in convert's table.
std::vector<std::string> split_regexes(const json& pre) {
  std::vector<std::string> out;
  std::function<void(const json&)> walk = [&](const json& n) {
    if (!n.is_object()) return;
    const std::string type = n.value("type", "");
    if (type == "Sequence") {
      for (const json& c : n.value("pretokenizers", json::array())) walk(c);
    } else if (type == "Split" && n.contains("pattern") && n["pattern"].is_object() && n["pattern"].contains("Regex")) {
      out.push_back(n["pattern"]["Regex"].get<std::string>());
    } else if (type == "ByteLevel" && n.value("use_regex", true)) {
      out.push_back(detail::kGpt2Pattern);
    }
  };
  walk(pre);
  return out;
}

std::vector<std::pair<std::string, GgufValue>> tokenizer_metadata(const std::string& folder);

}  // namespace

std::vector<std::pair<std::string, GgufValue>> gguf_tokenizer_metadata(const std::string& folder) {
  try {
    return tokenizer_metadata(folder);
  } catch (const json::exception& e) {  // a value of another type than tokenizers writes
    throw IoError(folder + "/tokenizer.json or tokenizer_config.json: " + e.what());
  }
}

namespace {

std::vector<std::pair<std::string, GgufValue>> tokenizer_metadata(const std::string& folder) {
  const std::filesystem::path dir = folder;
  const json file = read_json(dir / "tokenizer.json");
  json config = read_json(dir / "tokenizer_config.json");
  if (config.is_null()) config = json::object();
  const auto tokenizer = qkv::text::HfTokenizer::from_folder(dir.string());
  if (file.is_null() || !tokenizer)
    throw IoError(dir.string() + " has no tokenizer.json: a GGUF file carries the model's tokenizer, so qkv needs the "
                  "folder's (download it with the weights)");
  const json& model = file["model"];

  // Every token by id: the model's vocabulary and the added tokens.
  std::map<int64_t, std::string> by_id;
  for (const auto& [token, id] : model["vocab"].items()) by_id[id.get<int64_t>()] = token;
  std::map<int64_t, json> added;  // id → its added_tokens entry
  for (const json& a : file.value("added_tokens", json::array())) {
    by_id[a["id"].get<int64_t>()] = a["content"].get<std::string>();
    added[a["id"].get<int64_t>()] = a;
  }
  if (by_id.empty() || by_id.begin()->first < 0 || by_id.rbegin()->first >= (int64_t{1} << 31))
    throw IoError(dir.string() + "/tokenizer.json: its ids are not 0 … 2^31 − 1");
  const int64_t vocab_size = by_id.rbegin()->first + 1;
  const bool spm = model.value("byte_fallback", false) && file.contains("decoder") && file["decoder"].is_object() &&
                   file["decoder"].value("type", "") == "Sequence";

  std::vector<std::string> tokens(static_cast<size_t>(vocab_size));
  std::vector<int32_t> types(static_cast<size_t>(vocab_size), kUnused);
  std::vector<float> scores(static_cast<size_t>(vocab_size), -10000.0f);
  for (int64_t i = 0; i < vocab_size; ++i) tokens[static_cast<size_t>(i)] = "[PAD" + std::to_string(i) + "]";
  std::vector<std::string> merges;
  for (const json& m : model.value("merges", json::array())) {
    if (m.is_string()) merges.push_back(m);
    else merges.push_back(replace_all(m[0].get<std::string>(), " ", "\xC4\xA0") + " " + replace_all(m[1].get<std::string>(), " ", "\xC4\xA0"));
  }
  std::vector<std::pair<std::string, GgufValue>> meta;

  if (spm) {
    // The first merge that makes each piece: its score is −rank (SentencePiece scores pieces by learning order).
    std::map<std::string, int64_t> made_by;
    for (size_t r = 0; r < merges.size(); ++r) {
      const size_t space = merges[r].find(' ', 1);
      made_by.try_emplace(merges[r].substr(0, space) + merges[r].substr(space + 1), static_cast<int64_t>(r));
    }
    const std::string unk = model.value("unk_token", json()).is_string() ? model["unk_token"].get<std::string>() : "";
    for (const auto& [token, id_json] : model["vocab"].items()) {
      const auto id = static_cast<size_t>(id_json.get<int64_t>());
      tokens[id] = token;
      const bool byte = token.size() == 6 && token.compare(0, 3, "<0x") == 0 && token[5] == '>';
      types[id] = token == unk ? kUnknown : byte ? kByte : added.count(static_cast<int64_t>(id)) && added[static_cast<int64_t>(id)].value("special", false) ? kControl : kNormal;
      const auto made = made_by.find(token);
      // A single character is never a merge's result (scored below every merged piece); a longer piece no merge
      // makes, last of all.
      size_t characters = 0;
      for (unsigned char c : token) characters += (c & 0xC0) != 0x80;
      scores[id] = types[id] != kNormal ? 0.0f
                   : made != made_by.end() ? -static_cast<float>(made->second)
                   : characters <= 1       ? -static_cast<float>(merges.size() + id)
                                           : -1e9f;
    }
    for (const auto& [id, a] : added) {  // tokenizer_config.json's added_tokens_decoder, as tokenizer.json lists it
      std::string content = a["content"];
      if (a.value("special", false) || looks_special(content)) {
        types[static_cast<size_t>(id)] = kControl;
      } else {
        content = replace_all(content, "\xE2\x96\x81", " ");
        types[static_cast<size_t>(id)] = kUserDefined;
      }
      if (types[static_cast<size_t>(id)] != kUnknown) scores[static_cast<size_t>(id)] = -1000.0f;
      tokens[static_cast<size_t>(id)] = content;
    }
    bool prepend = false;
    std::function<void(const json&)> find_prepend = [&](const json& n) {
      if (!n.is_object()) return;
      if (n.value("type", "") == "Prepend") prepend = true;
      for (const json& c : n.value("normalizers", json::array())) find_prepend(c);
    };
    if (file.contains("normalizer")) find_prepend(file["normalizer"]);
    meta.emplace_back("tokenizer.ggml.model", GgufValue::string("llama"));
    meta.emplace_back("tokenizer.ggml.pre", GgufValue::string("default"));
    meta.emplace_back("tokenizer.ggml.add_space_prefix", GgufValue::boolean(prepend));
    merges.clear();  // SpecialVocab(load_merges=False)
  } else {
    for (int64_t i = 0; i < vocab_size; ++i) {
      const auto it = by_id.find(i);
      if (it == by_id.end()) continue;
      std::string token = it->second;
      if (added.count(i)) {
        const json& a = added[i];
        if (!a.value("normalized", !a.value("special", false))) token = tokenizer->decode(tokenizer->encode_rendered(token));
        if (a.value("special", false) || looks_special(token)) {
          types[static_cast<size_t>(i)] = kControl;
        } else {
          token = replace_all(token, "\xE2\x96\x81", " ");
          types[static_cast<size_t>(i)] = kUserDefined;
        }
      } else {
        types[static_cast<size_t>(i)] = kNormal;
      }
      tokens[static_cast<size_t>(i)] = token;
    }
    const std::string hash = sha256_hex(python_list(tokenizer->encode(kChkTxt)));
    const auto known = pre_by_hash().find(hash);
    std::string pre = known != pre_by_hash().end() ? known->second : "";
    if (pre.empty() && file.contains("pre_tokenizer")) pre = detail::gguf_pre_for_regexes(split_regexes(file["pre_tokenizer"]));
    if (pre.empty())
      throw IoError(dir.string() + "/tokenizer.json: its byte-level pre-tokenizer is not one llama.cpp knows (chkhsh " +
                    hash + ", and its Split regexes match none of llama.cpp's), so llama.cpp could not tokenize as it "
                    "does; convert_hf_to_gguf.py refuses it too");
    meta.emplace_back("tokenizer.ggml.model", GgufValue::string("gpt2"));
    meta.emplace_back("tokenizer.ggml.pre", GgufValue::string(pre));
  }
  meta.emplace_back("tokenizer.ggml.tokens", GgufValue::strings(tokens));
  if (spm) meta.emplace_back("tokenizer.ggml.scores", GgufValue::f32s(scores));
  meta.emplace_back("tokenizer.ggml.token_type", GgufValue::i32s(types));
  if (!merges.empty()) meta.emplace_back("tokenizer.ggml.merges", GgufValue::strings(merges));

  // SpecialVocab: ids of the config's special tokens among the added tokens; add_bos/add_eos.
  std::map<std::string, bool> add;
  std::string bos_text = token_text(config.value("bos_token", json())), eos_text = token_text(config.value("eos_token", json()));
  if (file.contains("post_processor") && file["post_processor"].is_object()) {
    const json& post = file["post_processor"];
    const json processors = post.contains("processors") ? post["processors"] : json::array({post});
    for (const json& p : processors) {
      if (p.value("type", "") != "TemplateProcessing") continue;
      const json single = p.value("single", json::array());
      if (single.size() <= 1) continue;
      const std::string first = single.front().contains("SpecialToken") ? single.front()["SpecialToken"].value("id", "") : "";
      const std::string last = single.back().contains("SpecialToken") ? single.back()["SpecialToken"].value("id", "") : "";
      if (!first.empty()) {
        if (bos_text.empty()) bos_text = first;
        add["bos"] = first == bos_text;
      }
      if (!last.empty()) {
        if (eos_text.empty()) eos_text = last;
        add["eos"] = last == eos_text;
      }
    }
  }
  const std::map<std::string, std::string> id_keys = {{"bos", "bos_token_id"}, {"eos", "eos_token_id"}, {"unk", "unknown_token_id"},
                                                      {"sep", "seperator_token_id"}, {"pad", "padding_token_id"},
                                                      {"cls", "cls_token_id"}, {"mask", "mask_token_id"}};
  for (const char* type : {"bos", "eos", "unk", "sep", "pad", "cls", "mask"}) {
    const std::string key = std::string("add_") + type + "_token";
    if (config.contains(key) && config[key].is_boolean()) add[type] = config[key].get<bool>();
    std::string text = token_text(config.value(std::string(type) + "_token", json()));
    if (std::string(type) == "bos") text = bos_text.empty() ? text : bos_text;
    if (std::string(type) == "eos") text = eos_text.empty() ? text : eos_text;
    if (text.empty()) continue;
    for (const json& a : file.value("added_tokens", json::array()))
      if (a["content"] == text) {
        meta.emplace_back("tokenizer.ggml." + id_keys.at(type), GgufValue::u32(a["id"].get<uint32_t>()));
        break;
      }
  }
  for (const auto& [type, value] : add)
    if (type == "bos" || type == "eos") meta.emplace_back("tokenizer.ggml.add_" + type + "_token", GgufValue::boolean(value));
  // the template as transformers finds it (chat_template.jinja first)
  if (!tokenizer->chat_template().empty()) meta.emplace_back("tokenizer.chat_template", GgufValue::string(tokenizer->chat_template()));

  return meta;
}

}  // namespace

}  // namespace qkv::text
