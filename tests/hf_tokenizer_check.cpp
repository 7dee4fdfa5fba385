// qkv's tokenizer.json against what Hugging Face's tokenizers gave (tests/hf_tokenizer_cases.js's JSON): for each
// model and case, tokenizer(text) ids, the ids without the post-processor, decode with and without special tokens and
// decode of each run of 5 ids must be identical. Prints the first difference of each kind; exit 1 on any.
// Not a unit test of qkv's parts (test_hf_tokenizer.cpp) nor a corpus test (tokenizer_vs_hf.sh).
// With GGUF_DIR, each model's NAME.gguf (tools/tokenizer_to_gguf.cpp) is checked too, through HfTokenizer::from_gguf.
//   hf_tokenizer_check CASES_JSON [GGUF_DIR]
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "qkv/core/error.hpp"
#include "qkv/io/gguf.hpp"
#include "qkv/text/hf_tokenizer.hpp"

namespace {

using json = nlohmann::json;

std::string ids_text(const std::vector<int64_t>& ids, size_t from, size_t to) {
  std::string s = "[";
  for (size_t i = from; i < std::min(to, ids.size()); ++i) s += (i > from ? " " : "") + std::to_string(ids[i]);
  return s + "]";
}

// The first index where a and b differ, with a few ids either side.
bool same_ids(const std::string& what, const std::vector<int64_t>& qkv, const std::vector<int64_t>& hf,
              const char* reference = "Hugging Face") {
  if (qkv == hf) return true;
  size_t i = 0;
  while (i < qkv.size() && i < hf.size() && qkv[i] == hf[i]) ++i;
  const size_t from = i >= 3 ? i - 3 : 0;
  std::printf("FAIL: %s: ids differ at %zu (qkv %zu ids, %s %zu): qkv %s vs %s\n", what.c_str(), i, qkv.size(), reference,
              hf.size(), ids_text(qkv, from, i + 6).c_str(), ids_text(hf, from, i + 6).c_str());
  return false;
}

std::string escaped(const std::string& s) { return json(s).dump(-1, ' ', false, json::error_handler_t::replace); }

bool same_text(const std::string& what, const std::string& qkv, const std::string& hf) {
  if (qkv == hf) return true;
  size_t i = 0;
  while (i < qkv.size() && i < hf.size() && qkv[i] == hf[i]) ++i;
  const size_t from = i >= 12 ? i - 12 : 0;
  std::printf("FAIL: %s: text differs at byte %zu: qkv %s vs %s\n", what.c_str(), i,
              escaped(qkv.substr(from, 40)).c_str(), escaped(hf.substr(from, 40)).c_str());
  return false;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || argc > 4) {
    std::fprintf(stderr, "usage: hf_tokenizer_check CASES_JSON [GGUF_DIR [LLAMACPP_DIR]] (CASES_JSON written by "
                         "tests/hf_tokenizer_cases.js)\n");
    return 2;
  }
  const std::string gguf_dir = argc >= 3 ? argv[2] : "", llamacpp_dir = argc >= 4 ? argv[3] : "";
  std::ifstream in(argv[1]);
  std::stringstream buffer;
  buffer << in.rdbuf();
  const json families = json::parse(buffer.str());
  int failures = 0;
  size_t total_ids = 0;
  for (const json& family : families) {
    const std::string name = family.at("name");
    const std::string dir = family.at("dir");
    std::unique_ptr<qkv::text::HfTokenizer> tokenizer;
    try {
      tokenizer = qkv::text::HfTokenizer::from_folder(dir);
    } catch (const std::exception& e) {
      std::printf("FAIL: %s: %s\n", name.c_str(), e.what());
      ++failures;
      continue;
    }
    if (!tokenizer) {
      std::printf("FAIL: %s has no tokenizer.json\n", dir.c_str());
      ++failures;
      continue;
    }
    // The same model as a GGUF file's tokenizer metadata (tools/tokenizer_to_gguf.cpp wrote GGUF_DIR/NAME.gguf):
    // the ids of the text between special tokens, and the text of Hugging Face's ids, must be the same. (Whether
    // BOS/EOS are added is the GGUF file's own add_bos_token/add_eos_token, checked against llama.cpp instead.)
    const std::string gguf_path = gguf_dir.empty() ? "" : gguf_dir + "/" + name + ".gguf";
    if (!gguf_path.empty() && std::filesystem::exists(gguf_path)) {
      try {
        const auto gguf = qkv::text::HfTokenizer::from_gguf(qkv::io::GgufFile::open(gguf_path));
        for (const json& c : family.at("cases")) {
          const std::string what = name + " " + c.at("label").get<std::string>() + " from GGUF";
          const auto ids = c.at("ids").get<std::vector<int64_t>>();
          bool ok = same_ids(what + " without the post-processor", gguf->encode_rendered(c.at("text").get<std::string>()), c.at("ids_rendered"));
          ok &= same_text(what + " decode", gguf->decode(ids), c.at("decoded"));
          failures += ok ? 0 : 1;
          if (ok) std::printf("%s: %zu ids, identical\n", what.c_str(), c.at("ids_rendered").size());
        }
        // llama.cpp's llama_tokenize on the same file, with BOS/EOS as the file says: LLAMACPP_DIR/NAME.K.txt is
        // case K's text (less the lines where llama.cpp departs from the tokenizer.json: tokenizer_cases_vs_hf.sh),
        // LLAMACPP_DIR/NAME.llamacpp a line "ids: [...]" per case.
        std::ifstream theirs(llamacpp_dir + "/" + name + ".llamacpp");
        std::string line;
        for (size_t k = 0; !llamacpp_dir.empty() && theirs && k < family.at("cases").size() && std::getline(theirs, line); ++k) {
          const json& c = family.at("cases")[k];
          const std::string what = name + " " + c.at("label").get<std::string>() + " from GGUF against llama.cpp";
          std::ifstream text_file(llamacpp_dir + "/" + name + "." + std::to_string(k) + ".txt", std::ios::binary);
          std::stringstream text;
          text << text_file.rdbuf();
          const auto ids = json::parse(line.substr(line.find('['))).get<std::vector<int64_t>>();
          const bool ok = same_ids(what, gguf->encode(text.str()), ids, "llama.cpp");
          failures += ok ? 0 : 1;
          if (ok) std::printf("%s: %zu bytes, %zu ids, identical\n", what.c_str(), text.str().size(), ids.size());
        }
      } catch (const std::exception& e) {
        std::printf("FAIL: %s: %s\n", gguf_path.c_str(), e.what());
        ++failures;
      }
    }
    for (const json& c : family.at("cases")) {
      const std::string what = name + " " + c.at("label").get<std::string>();
      const std::string text = c.at("text");
      const auto ids = c.at("ids").get<std::vector<int64_t>>();
      bool ok = same_ids(what + " tokenizer(text)", tokenizer->encode(text), ids);
      ok &= same_ids(what + " without the post-processor", tokenizer->encode_rendered(text), c.at("ids_rendered"));
      ok &= same_text(what + " decode", tokenizer->decode(ids), c.at("decoded"));
      ok &= same_text(what + " decode without special tokens", tokenizer->decode_text(ids), c.at("decoded_text"));
      const auto& chunks = c.at("chunks");
      for (size_t k = 0, at = 0; k < chunks.size(); ++k, at += 5) {
        const std::vector<int64_t> run(ids.begin() + static_cast<std::ptrdiff_t>(at),
                                       ids.begin() + static_cast<std::ptrdiff_t>(std::min(at + 5, ids.size())));
        if (!same_text(what + " decode of ids " + ids_text(run, 0, 5), tokenizer->decode(run), chunks[k])) {
          ok = false;
          break;
        }
      }
      total_ids += ids.size();
      failures += ok ? 0 : 1;
      if (ok) std::printf("%s: %zu bytes, %zu ids, %zu decodes: identical\n", what.c_str(), text.size(), ids.size(), chunks.size() + 2);
    }
  }
  if (failures) {
    std::printf("%d case(s) differ from Hugging Face\n", failures);
    return 1;
  }
  std::printf("every case identical to Hugging Face (%zu ids)\n", total_ids);
  return 0;
}
