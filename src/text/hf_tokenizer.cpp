// tokenizer.json read into the pipeline of hf_pipeline.hpp (see qkv/text/hf_tokenizer.hpp), and the tokenizer's
// encode and decode. Not here: the pipeline's parts (hf_pipeline.hpp), GGUF metadata (gguf_tokenizer.cpp).
#include "qkv/text/hf_tokenizer.hpp"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <fcntl.h>
#include <pcre2.h>
#include <simdjson.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <utf8proc.h>

#include <cstring>
#include <deque>
#include <functional>
#include <optional>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <queue>
#include <sstream>
#include <unordered_map>

#include "hf_pipeline.hpp"
#include "qkv/kernels/memory.hpp"

namespace qkv::text {

using namespace detail;

HfTokenizer::HfTokenizer(std::unique_ptr<State> state) : state_(std::move(state)) {}
HfTokenizer::~HfTokenizer() = default;

namespace {
std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw IoError(path + ": cannot be read (" + std::strerror(errno) + ")");
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

std::string token_text(const json& v) {
  if (v.is_string()) return v.get<std::string>();
  if (v.is_object() && v.contains("content") && v["content"].is_string()) return v["content"].get<std::string>();
  return "";
}
}  // namespace

namespace {

// What one pass over tokenizer.json finds besides the vocabulary and merges (which go into the model as they are
// read): the model's settings, the added tokens, and the small sections (normalizer, pre-tokenizer, post-processor,
// decoder) as nlohmann values. simdjson's On-Demand API walks the file once at GB/s; nlohmann's DOM took a third of a
// load, its maps another half (bench/tokenizer_load.cpp).
struct Scan {
  std::string type = "BPE";
  bool has_vocab = false;
  std::vector<AddedToken> added;
  std::optional<std::string> unk_token;
  bool byte_fallback = false, fuse_unk = false, ignore_merges = false;
  json normalizer, pre_tokenizer, post_processor, decoder;  // null when absent
};

namespace od = simdjson::ondemand;

bool is_null(od::value& v) { return v.type().value() == od::json_type::null; }

std::string_view string_of(od::value v, const std::string& what, const std::string& label) {
  std::string_view out;
  if (v.get_string().get(out)) throw IoError(label + ": " + what + " is not a string");
  return out;
}

bool bool_of(od::value v, const std::string& what, const std::string& label) {
  if (is_null(v)) return false;
  bool out = false;
  if (v.get_bool().get(out)) throw IoError(label + ": " + what + " is not true or false");
  return out;
}

// Appends code point cp as UTF-8.
void append_utf8(std::string& out, uint32_t cp) { detail::append_utf8(out, cp); }

// A JSON string's text from its raw bytes: p is just after its opening quote, in a document whose structure simdjson
// has checked (so a closing quote follows). The common string, without escapes, is a view of the document's own bytes
// (no copy into simdjson's buffer, whose fresh pages cost more than the parse); one with escapes is unescaped into
// `scratch` (whose element must then outlive the view). nullopt for a malformed escape.
std::optional<std::string_view> json_string(const char* p, std::deque<std::string>& scratch) {
  const char* q = p;
  while (*q != '"' && *q != '\\') ++q;
  if (*q == '"') return std::string_view(p, static_cast<size_t>(q - p));
  std::string& out = scratch.emplace_back(p, q);
  auto hex4 = [](const char* h, uint32_t& v) {
    v = 0;
    for (int k = 0; k < 4; ++k) {
      const char c = h[k];
      const int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
      if (d < 0) return false;
      v = v * 16 + static_cast<uint32_t>(d);
    }
    return true;
  };
  while (*q != '"') {
    if (*q != '\\') {
      out += *q++;
      continue;
    }
    const char e = q[1];
    q += 2;
    switch (e) {
      case '"': out += '"'; break;
      case '\\': out += '\\'; break;
      case '/': out += '/'; break;
      case 'b': out += '\b'; break;
      case 'f': out += '\f'; break;
      case 'n': out += '\n'; break;
      case 'r': out += '\r'; break;
      case 't': out += '\t'; break;
      case 'u': {
        uint32_t cp = 0, low = 0;
        if (!hex4(q, cp)) return std::nullopt;
        q += 4;
        if (cp >= 0xDC00 && cp <= 0xDFFF) return std::nullopt;  // a low surrogate alone
        if (cp >= 0xD800 && cp <= 0xDBFF) {                       // a high one: its low one follows
          if (q[0] != '\\' || q[1] != 'u' || !hex4(q + 2, low) || low < 0xDC00 || low > 0xDFFF) return std::nullopt;
          q += 6;
          cp = 0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00);
        }
        append_utf8(out, cp);
        break;
      }
      default:
        return std::nullopt;
    }
  }
  return std::string_view(out);
}

// The model's vocabulary and merges, put into the BPE model a batch at a time while the file is read: each batch's
// lookups overlap their cache misses, and no list of the whole file's strings is kept. The views point into the
// parser's buffer of unescaped strings, valid while the parser lives. Merges are resolved against the model's own
// vocabulary (added tokens come after it, as in tokenizers, whose BPE model knows nothing of them).
class ModelBuilder {
 public:
  ModelBuilder(detail::BpeModel& model, const std::string& label) : model_(model), label_(label) {}

  // `entries` tokens whose texts take at most `bytes` (the file's size: only the pages used are touched).
  void vocab_size_hint(size_t entries, size_t bytes) {
    max_id_ = static_cast<int64_t>(entries) + kMaxIdGap;
    model_.vocab.reserve(entries, bytes);
  }
  void add_token(std::string_view token, int64_t id) {
    if (id < 0 || id >= max_id_)
      throw IoError(label_ + ": model.vocab id " + std::to_string(id) + " of " + printable(std::string(token), 60) +
                    " is outside [0, " + std::to_string(max_id_) + "): ids are numbered from 0 without large gaps");
    tokens_.emplace_back(token, static_cast<int32_t>(id));
    if (tokens_.size() == kChunk) flush_tokens();
  }
  // The text of the JSON string whose raw bytes start at p, valid until the batch it joins is flushed.
  std::string_view string(const char* p, const char* what) {
    const auto text = json_string(p, escaped_);
    if (!text) throw IoError(label_ + ": " + what + " holds a malformed escape sequence");
    return *text;
  }
  void vocab_done() {
    flush_tokens();
    vocab_done_ = true;
    for (const auto& [a, b] : early_merges_) add_merge(a, b);  // merges listed before the vocabulary
    flush_merges();  // the batch views those copies: looked up before they go
    early_merges_ = {};
  }
  void merges_size_hint(size_t merges) { merges_.reserve(merges); }
  void add_merge(std::string_view a, std::string_view b) {
    if (!vocab_done_) {
      early_merges_.emplace_back(a, b);  // copies: the views die with their batch
      return;
    }
    pairs_.emplace_back(a, b);
    if (pairs_.size() == kChunk) flush_merges();
  }
  void merges_done() { flush_merges(); }
  detail::BigVector<detail::MergeTable::Merge> take_merges() { return std::move(merges_); }

 private:
  static constexpr size_t kChunk = 256;

  void flush_tokens() {
    model_.vocab.set_all(tokens_);
    tokens_.clear();
    escaped_.clear();
  }
  // Each merge's two tokens and their concatenation, looked up together.
  void flush_merges() {
    joined_.clear();
    for (const auto& [a, b] : pairs_) joined_.append(a).append(b);
    texts_.clear();
    for (size_t k = 0, offset = 0; k < pairs_.size(); ++k) {
      const auto& [a, b] = pairs_[k];
      texts_.insert(texts_.end(), {a, b, std::string_view(joined_).substr(offset, a.size() + b.size())});
      offset += a.size() + b.size();
    }
    ids_.resize(texts_.size());
    model_.vocab.find_all(texts_, ids_.data());
    for (size_t k = 0; k < pairs_.size(); ++k) {
      const int32_t ia = ids_[3 * k], ib = ids_[3 * k + 1], im = ids_[3 * k + 2];
      const auto rank = static_cast<int32_t>(merges_.size());
      if (ia < 0 || ib < 0 || im < 0) {
        const std::string unknown(texts_[3 * k + (ia < 0 ? 0 : ib < 0 ? 1 : 2)]);
        throw IoError(label_ + ": merges entry " + std::to_string(rank) + " names " + printable(unknown, 60) +
                      ", which is not in the vocabulary; the file is damaged or from another model");
      }
      merges_.push_back({ia, ib, rank, im});
    }
    pairs_.clear();
    if (vocab_done_) escaped_.clear();
  }

  detail::BpeModel& model_;
  const std::string& label_;
  int64_t max_id_ = kMaxIdGap;
  bool vocab_done_ = false;
  std::vector<std::pair<std::string_view, int32_t>> tokens_;
  std::vector<std::pair<std::string_view, std::string_view>> pairs_;
  std::vector<std::pair<std::string, std::string>> early_merges_;
  std::deque<std::string> escaped_;  // this batch's strings that had escapes (a deque: their views stay valid)
  detail::BigVector<detail::MergeTable::Merge> merges_;
  std::string joined_;
  std::vector<std::string_view> texts_;
  std::vector<int32_t> ids_;
};

void scan_model(od::object model, Scan& scan, ModelBuilder& builder, size_t file_bytes, const std::string& label) {
  bool has_merges = false;
  for (auto field : model) {
    const std::string_view key = field.unescaped_key();
    od::value value = field.value();
    if (key == "type") {
      scan.type = std::string(string_of(value, "model.type", label));
    } else if (key == "vocab") {
      od::object vocab;
      if (value.get_object().get(vocab)) continue;  // Unigram's is a list: the type check names the problem
      scan.has_vocab = true;
      size_t count = 0;
      if (vocab.count_fields().get(count)) throw IoError(label + ": model.vocab is not valid JSON");
      builder.vocab_size_hint(count + scan.added.size(), file_bytes);
      for (auto entry : vocab) {
        const std::string_view token = builder.string(entry.key().value().raw(), "a model.vocab key");
        int64_t id = 0;
        if (entry.value().get_int64().get(id))
          throw IoError(label + ": model.vocab[" + printable(std::string(token), 60) + "] is not an integer id");
        builder.add_token(token, id);
      }
      builder.vocab_done();
    } else if (key == "merges") {
      od::array merges;
      if (value.get_array().get(merges)) throw IoError(label + ": model.merges is not a list");
      has_merges = true;
      size_t count = 0;
      if (!merges.count_elements().get(count)) builder.merges_size_hint(count);
      size_t rank = 0;
      for (od::value m : merges) {
        std::string_view line, pair[2];
        od::raw_json_string raw;
        if (!m.get_raw_json_string().get(raw)) {  // "a b"
          line = builder.string(raw.raw(), "a merges entry");
          const size_t space = line.find(' ');
          if (space == std::string_view::npos || line.find(' ', space + 1) != std::string_view::npos)
            throw IoError(label + ": merges entry " + std::to_string(rank) + " (" + printable(std::string(line), 60) +
                          ") is not two tokens separated by one space");
          builder.add_merge(line.substr(0, space), line.substr(space + 1));
        } else {  // ["a", "b"]
          od::array parts;
          size_t n = 0;
          bool ok = !m.get_array().get(parts);
          if (ok)
            for (od::value part : parts) {
              ok = ok && n < 2 && !part.get_raw_json_string().get(raw);
              if (ok) pair[n++] = builder.string(raw.raw(), "a merges entry");
            }
          if (!ok || n != 2) throw IoError(label + ": merges entry " + std::to_string(rank) + " is not a pair of tokens");
          builder.add_merge(pair[0], pair[1]);
        }
        ++rank;
      }
    } else if (key == "unk_token") {
      if (!is_null(value)) scan.unk_token = std::string(string_of(value, "model.unk_token", label));
    } else if (key == "byte_fallback") {
      scan.byte_fallback = bool_of(value, "model.byte_fallback", label);
    } else if (key == "fuse_unk") {
      scan.fuse_unk = bool_of(value, "model.fuse_unk", label);
    } else if (key == "ignore_merges") {
      scan.ignore_merges = bool_of(value, "model.ignore_merges", label);
    } else if (key == "continuing_subword_prefix" || key == "end_of_word_suffix") {
      if (!is_null(value) && !string_of(value, "model." + std::string(key), label).empty())
        throw IoError(label + ": model." + std::string(key) + " is set; qkv's BPE has none");
    } else if (key == "dropout") {
      double dropout = 0;
      if (!is_null(value) && (value.get_double().get(dropout) || dropout != 0.0))
        throw IoError(label + ": model.dropout is set; BPE dropout is for training tokenizers, qkv has none");
    }
  }
  if (!scan.has_vocab && has_merges) builder.vocab_done();  // the type check below names the problem
  builder.merges_done();
}

void scan_added_tokens(od::array list, Scan& scan, const std::string& label) {
  for (od::value item : list) {
    AddedToken t;
    bool has_content = false, has_id = false, has_normalized = false;
    od::object a;
    if (item.get_object().get(a)) throw IoError(label + ": added_tokens entry " + std::to_string(scan.added.size()) + " is not an object");
    for (auto field : a) {
      const std::string_view key = field.unescaped_key();
      od::value v = field.value();
      const auto what = [&] { return "added_tokens entry " + std::to_string(scan.added.size()) + "'s " + std::string(key); };
      if (key == "content") {
        std::string_view content;
        has_content = !v.get_string().get(content);
        t.content = std::string(content);
      } else if (key == "id") {
        has_id = !v.get_int64().get(t.id);
      } else if (key == "special") {
        t.special = bool_of(v, what(), label);
      } else if (key == "lstrip") {
        t.lstrip = bool_of(v, what(), label);
      } else if (key == "rstrip") {
        t.rstrip = bool_of(v, what(), label);
      } else if (key == "single_word") {
        t.single_word = bool_of(v, what(), label);
      } else if (key == "normalized") {
        t.normalized = bool_of(v, what(), label);
        has_normalized = true;
      }
    }
    if (!has_content || !has_id)
      throw IoError(label + ": added_tokens entry " + std::to_string(scan.added.size()) + " needs a string content and an integer id");
    if (!has_normalized) t.normalized = !t.special;  // AddedToken::from(content, special)'s default
    scan.added.push_back(std::move(t));
  }
}

// A small section as an nlohmann value (its components' readers take those).
json section(od::value v, const std::string& key, const std::string& label) {
  if (is_null(v)) return nullptr;
  std::string_view raw;
  od::object o;
  if (v.get_object().get(o) || o.raw_json().get(raw)) throw IoError(label + ": " + key + " is not an object");
  try {
    return json::parse(raw);
  } catch (const json::exception& e) {
    throw IoError(label + ": " + key + " is malformed (" + e.what() + ")");
  }
}

// simdjson's On-Demand parser keeps its structural index (4 bytes for each string, number, comma, colon and bracket) in
// a private new[] of 4 bytes per byte of the document, and its first stage writes the index front to back before
// anything is read: for Qwen3's 11 MB tokenizer.json 6 MB of fresh 4 KiB pages, ~1,500 page faults, 13 of a load's
// 60 ms on the virtual machines measured. Reached through the one access C++ allows to a private member (a pointer to it
// named in an explicit instantiation), the index's 2 MiB-aligned part is asked for huge pages and the part before the
// first boundary is populated in one call; iterate then 4.6 ms instead of 17.7 (medians of 6). A hint: refused, the
// parse is as before.
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux 5.14; older kernels refuse it, and the pages fault as before
#endif
using ParserImplementation = std::unique_ptr<simdjson::internal::dom_parser_implementation>;
ParserImplementation& implementation_of(od::parser& parser);
template <ParserImplementation od::parser::*Member>
struct ParserAccess {
  friend ParserImplementation& implementation_of(od::parser& parser) { return parser.*Member; }
};
template struct ParserAccess<&od::parser::implementation>;

void allocate_parser(od::parser& parser, size_t document_bytes) {
  if (parser.allocate(document_bytes)) return;  // iterate fails the same way and names it
  const ParserImplementation& implementation = implementation_of(parser);
  if (!implementation || !implementation->structural_indexes) return;
  constexpr uintptr_t kHuge = uintptr_t{2} << 20, kPage = 4096;
  const auto begin = reinterpret_cast<uintptr_t>(implementation->structural_indexes.get());
  const uintptr_t end = begin + document_bytes * sizeof(uint32_t);  // at most what simdjson allocated
  const uintptr_t first_huge = (begin + kHuge - 1) & ~(kHuge - 1), last_huge = end & ~(kHuge - 1);
  if (last_huge > first_huge) ::madvise(reinterpret_cast<void*>(first_huge), last_huge - first_huge, MADV_HUGEPAGE);
  const uintptr_t first_page = (begin + kPage - 1) & ~(kPage - 1), populated = std::min(first_huge, end & ~(kPage - 1));
  if (populated > first_page) ::madvise(reinterpret_cast<void*>(first_page), populated - first_page, MADV_POPULATE_WRITE);
}

// The whole file in one pass: the model's vocabulary and merges into s.model, the rest into the Scan.
Scan scan_file(simdjson::padded_string_view bytes, HfTokenizer::State& s, const std::string& label) {
  Scan scan;
  bool has_model = false;
  od::parser parser;
  ModelBuilder builder(s.model, label);
  try {
    // A value of another type is the file's mistake to name; any other error is JSON that does not parse.
    auto expect = [&](simdjson::error_code e, const std::string& problem) {
      if (e == simdjson::INCORRECT_TYPE) throw IoError(label + ": " + problem);
      if (e) throw simdjson::simdjson_error(e);
    };
    allocate_parser(parser, bytes.length());
    od::document doc = parser.iterate(bytes);
    od::object top;
    expect(doc.get_object().get(top), "has no 'model' object; a tokenizer.json has one");
    for (auto field : top) {
      const std::string_view key = field.unescaped_key();
      od::value value = field.value();
      if (key == "model") {
        od::object model;
        expect(value.get_object().get(model), "has no 'model' object; a tokenizer.json has one");
        has_model = true;
        scan_model(model, scan, builder, bytes.length(), label);
      } else if (key == "added_tokens") {
        if (is_null(value)) continue;
        od::array list;
        expect(value.get_array().get(list), "added_tokens is not a list");
        scan_added_tokens(list, scan, label);
      } else if (key == "normalizer") {
        scan.normalizer = section(value, "normalizer", label);
      } else if (key == "pre_tokenizer") {
        scan.pre_tokenizer = section(value, "pre_tokenizer", label);
      } else if (key == "post_processor") {
        scan.post_processor = section(value, "post_processor", label);
      } else if (key == "decoder") {
        scan.decoder = section(value, "decoder", label);
      }
    }
    const char* rest = nullptr;  // OUT_OF_BOUNDS once the whole text is consumed
    if (!doc.current_location().get(rest)) throw IoError(label + ": has text after its JSON object");
  } catch (const simdjson::simdjson_error& e) {
    throw IoError(label + ": not valid JSON (" + e.what() + ")");
  }
  if (!has_model) throw IoError(label + ": has no 'model' object; a tokenizer.json has one");
  if (scan.type != "BPE") throw IoError(label + ": model type '" + printable(scan.type, 40) + "' is not supported; qkv reads BPE");
  if (!scan.has_vocab) throw IoError(label + ": model.vocab is not an object");
  s.model.merges.build(builder.take_merges(), s.model.vocab.size());
  return scan;
}

// The added tokens after the model's vocabulary (their text now finds their id), and the model's settings.
void add_tokens(const Scan& scan, HfTokenizer::State& s, const std::string& label) {
  const int64_t max_id = static_cast<int64_t>(s.model.vocab.size()) + static_cast<int64_t>(scan.added.size()) + kMaxIdGap;
  for (const AddedToken& t : scan.added) {
    if (t.content.empty()) continue;
    if (t.id < 0 || t.id >= max_id)
      throw IoError(label + ": added_tokens id " + std::to_string(t.id) + " of " + printable(t.content, 60) + " is outside [0, " +
                    std::to_string(max_id) + "): ids are numbered from 0 without large gaps");
    s.model.vocab.set(static_cast<int32_t>(t.id), t.content);
  }
  s.special.assign(static_cast<size_t>(s.model.vocab.size()), false);
  for (const AddedToken& t : scan.added) {
    if (t.content.empty()) continue;
    s.special[static_cast<size_t>(t.id)] = t.special;
    s.added.push_back(t);
  }
  s.model.ignore_merges = scan.ignore_merges;
  s.model.byte_fallback = scan.byte_fallback;
  s.model.fuse_unk = scan.fuse_unk;
  if (scan.unk_token) s.model.unk = s.id_of(*scan.unk_token);
  s.model.byte_tokens.fill(-1);
  if (s.model.byte_fallback) s.model.find_byte_tokens();
}

// The normalizer, pre-tokenizer, decoder and post-processor, then the tries of added tokens.
void build_components(const Scan& scan, HfTokenizer::State& s, const std::string& label) {
  try {
    if (!scan.normalizer.is_null()) s.normalizer = Normalizer::from(scan.normalizer, label);
    if (!scan.pre_tokenizer.is_null()) s.pre_tokenizer = PreTokenizer::from(scan.pre_tokenizer, label);
    if (!scan.decoder.is_null()) s.decoder = Decoder::from(scan.decoder, label);
    // The post-processor's single-sequence template, found in a TemplateProcessing alone or inside a Sequence.
    std::function<void(const json&)> post = [&](const json& p) {
      const std::string type = p.value("type", "");
      if (type == "Sequence") {
        for (const json& c : p.at("processors")) post(c);
      } else if (type == "TemplateProcessing") {
        s.has_template = true;
        s.template_items.clear();
        for (const json& item : p.at("single")) {
          if (item.contains("Sequence")) {
            s.template_items.push_back(-1);
          } else if (item.contains("SpecialToken")) {
            const std::string name = item["SpecialToken"].value("id", "");
            const json& specials = p.value("special_tokens", json::object());
            if (specials.contains(name) && specials[name].contains("ids")) {
              for (const json& id : specials[name]["ids"]) s.template_items.push_back(id.get<int64_t>());
            } else if (s.id_of(name) >= 0) {
              s.template_items.push_back(s.id_of(name));
            } else {
              throw IoError(label + ": post_processor names special token " + printable(name, 60) + ", which has no id");
            }
          }
        }
        for (int64_t id : s.template_items)
          if (id >= s.size()) throw IoError(label + ": post_processor id " + std::to_string(id) + " is outside the vocabulary");
      } else if (type != "ByteLevel") {
        throw IoError(label + ": post_processor '" + printable(type, 40) + "' is not supported; qkv has TemplateProcessing, "
                      "ByteLevel and Sequence");
      }
    };
    if (!scan.post_processor.is_null()) post(scan.post_processor);
  } catch (const json::exception& e) {
    throw IoError(label + ": malformed (" + std::string(e.what()) + ")");
  }
  s.finish();
}

// The file read into fresh memory in 2 MiB pages, with the padding simdjson reads past its end. A mapping of the page
// cache costs no copy but a first touch per 4 KiB page: on the virtual machines measured, reading a mapped 11 MB file
// once took 6 ms after MAP_POPULATE, where read() into huge pages (a copy at ~4 GB/s and 6 page faults) took 3.
class PaddedFile {
 public:
  explicit PaddedFile(const std::string& path) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) throw IoError(path + ": cannot be read (" + std::strerror(errno) + ")");
    struct stat st {};
    if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
      ::close(fd);
      throw IoError(path + ": cannot be read (not a regular file)");
    }
    size_ = static_cast<size_t>(st.st_size);
    // Read whole, so bounded first: the largest tokenizer.json published is ~35 MB (Gemma 3's)
    constexpr size_t kLimit = size_t{1} << 30;
    if (size_ > kLimit) {
      ::close(fd);
      throw IoError(path + ": " + std::to_string(size_) + " bytes is more than the " + std::to_string(kLimit) +
                    " qkv reads as a tokenizer.json (published ones are under 40 MB); is it the right file?");
    }
    length_ = size_ + simdjson::SIMDJSON_PADDING;
    data_ = static_cast<char*>(memory::map_huge_pages(length_));
    if (!data_) {
      ::close(fd);
      throw IoError(path + ": " + std::to_string(size_) + " bytes cannot be allocated to read it");
    }
    size_t got = 0;
    while (got < size_) {
      const ssize_t n = ::pread(fd, data_ + got, size_ - got, static_cast<off_t>(got));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        const std::string why = n < 0 ? std::strerror(errno) : "it became shorter while being read";
        ::close(fd);
        memory::unmap_huge_pages(data_, length_);
        throw IoError(path + ": cannot be read (" + why + ")");
      }
      got += static_cast<size_t>(n);
    }
    ::close(fd);
  }
  PaddedFile(const PaddedFile&) = delete;
  PaddedFile& operator=(const PaddedFile&) = delete;
  ~PaddedFile() { memory::unmap_huge_pages(data_, length_); }
  simdjson::padded_string_view view() const { return simdjson::padded_string_view(data_, size_, length_); }

 private:
  char* data_ = nullptr;
  size_t size_ = 0, length_ = 0;
};

std::unique_ptr<HfTokenizer::State> build_state(simdjson::padded_string_view bytes, std::string_view config_text,
                                                const std::string& label);

}  // namespace

std::unique_ptr<HfTokenizer> HfTokenizer::load(const std::string& tokenizer_path, const std::string& config_path) {
  std::string config;
  std::error_code ec;
  if (!config_path.empty() && std::filesystem::exists(config_path, ec)) config = read_text(config_path);
  const PaddedFile file(tokenizer_path);
  return std::unique_ptr<HfTokenizer>(new HfTokenizer(build_state(file.view(), config, tokenizer_path)));
}

std::unique_ptr<HfTokenizer> HfTokenizer::from_folder(const std::string& dir) {
  const std::filesystem::path p(dir);
  std::error_code ec;
  if (!std::filesystem::exists(p / "tokenizer.json", ec)) return nullptr;
  auto tokenizer = load((p / "tokenizer.json").string(), (p / "tokenizer_config.json").string());
  tokenizer->state_->chat_template = folder_chat_template(dir, tokenizer->state_->chat_template);
  return tokenizer;
}

std::string folder_chat_template(const std::string& dir, const std::string& config_template) {
  const std::filesystem::path p(dir);
  std::error_code ec;
  if (std::filesystem::exists(p / "chat_template.jinja", ec)) return read_text((p / "chat_template.jinja").string());
  if (!config_template.empty() || !std::filesystem::exists(p / "chat_template.json", ec)) return config_template;
  const std::string where = (p / "chat_template.json").string();
  json j;
  try {
    j = json::parse(read_text(where));
  } catch (const json::exception& e) {
    throw IoError(where + ": not valid JSON (" + std::string(e.what()) + ")");
  }
  if (!j.is_object() || !j.contains("chat_template") || !j["chat_template"].is_string())
    throw IoError(where + ": holds no \"chat_template\" string");
  return j["chat_template"].get<std::string>();
}

std::unique_ptr<HfTokenizer> HfTokenizer::parse(std::string_view text, std::string_view config_text, const std::string& label) {
  const simdjson::padded_string padded(text);
  return std::unique_ptr<HfTokenizer>(new HfTokenizer(build_state(padded, config_text, label)));
}

namespace {
std::unique_ptr<HfTokenizer::State> build_state(simdjson::padded_string_view bytes, std::string_view config_text,
                                                const std::string& label) {
  using State = HfTokenizer::State;
  auto state = std::make_unique<State>();
  State& s = *state;
  s.label = label;
  const Scan scan = scan_file(bytes, s, label);
  add_tokens(scan, s, label);
  build_components(scan, s, label);
  if (!config_text.empty()) {
    const std::string where = std::filesystem::path(label).parent_path().empty()
                                  ? std::string("tokenizer_config.json")
                                  : (std::filesystem::path(label).parent_path() / "tokenizer_config.json").string();
    json c;
    try {
      c = json::parse(config_text);
    } catch (const json::exception& e) {
      throw IoError(where + ": not valid JSON (" + std::string(e.what()) + ")");
    }
    if (!c.is_object()) throw IoError(where + ": not a JSON object");
    // transformers' LlamaTokenizerFast (and CodeLlama's, Gemma's, Cohere's) replace the file's post-processor by
    // "[bos] $A [eos]" from add_bos_token / add_eos_token (update_post_processor), their bos/eos defaulting to the
    // class's own: DeepSeek-V3's tokenizer.json adds no BOS, its LlamaTokenizerFast does.
    struct BosEosClass {
      const char* name;
      const char *bos, *eos;
    };
    static constexpr BosEosClass kBosEosClasses[] = {{"LlamaTokenizer", "<s>", "</s>"},
                                                     {"CodeLlamaTokenizer", "<s>", "</s>"},
                                                     {"GemmaTokenizer", "<bos>", "<eos>"},
                                                     {"CohereTokenizer", "<BOS_TOKEN>", "<|END_OF_TURN_TOKEN|>"}};
    std::string cls = c.contains("tokenizer_class") && c["tokenizer_class"].is_string() ? c["tokenizer_class"].get<std::string>() : "";
    if (cls.size() > 4 && cls.compare(cls.size() - 4, 4, "Fast") == 0) cls.resize(cls.size() - 4);
    const BosEosClass* bos_eos_class = nullptr;
    for (const BosEosClass& k : kBosEosClasses)
      if (cls == k.name) bos_eos_class = &k;
    std::string bos_text = bos_eos_class ? bos_eos_class->bos : "", eos_text = bos_eos_class ? bos_eos_class->eos : "";
    if (c.contains("eos_token")) eos_text = token_text(c["eos_token"]);
    if (c.contains("bos_token")) bos_text = token_text(c["bos_token"]);
    if (!eos_text.empty()) s.eos = s.id_of(eos_text);
    if (!bos_text.empty()) s.bos = s.id_of(bos_text);
    if (c.contains("pad_token")) {
      const std::string pad_text = token_text(c["pad_token"]);
      if (!pad_text.empty()) s.pad = s.id_of(pad_text);
    }
    if (bos_eos_class) {
      auto flag = [&](const char* key, bool fallback) {
        if (!c.contains(key) || c[key].is_null()) return fallback;
        if (!c[key].is_boolean()) throw IoError(where + ": " + key + " is " + describe(c[key]) + ", not true or false");
        return c[key].get<bool>();
      };
      const bool add_bos = flag("add_bos_token", true), add_eos = flag("add_eos_token", false);
      if (add_bos && s.bos < 0)
        throw IoError(where + ": add_bos_token is true but bos_token (" + printable(bos_text, 60) + ") is no token of " +
                      label + "; name the BOS token or set add_bos_token to false");
      if (add_eos && s.eos < 0)
        throw IoError(where + ": add_eos_token is true but eos_token (" + printable(eos_text, 60) + ") is no token of " +
                      label + "; name the EOS token or set add_eos_token to false");
      s.has_template = true;
      s.template_items.clear();
      if (add_bos) s.template_items.push_back(s.bos);
      s.template_items.push_back(-1);
      if (add_eos) s.template_items.push_back(s.eos);
    }
    if (c.contains("chat_template")) {
      const json& t = c["chat_template"];
      if (t.is_string()) {
        s.chat_template = t.get<std::string>();
      } else if (t.is_array()) {
        for (const json& named : t)
          if (named.is_object() && named.value("name", "") == "default" && named.contains("template") && named["template"].is_string())
            s.chat_template = named["template"].get<std::string>();
      }
    }
  }
  return state;
}
}  // namespace

std::vector<int64_t> HfTokenizer::encode_rendered(std::string_view text) const { return encode_impl(text, true, false); }

std::vector<int64_t> HfTokenizer::encode(std::string_view text, bool allow_special) const {
  return encode_impl(text, allow_special, allow_special);
}

std::vector<int64_t> HfTokenizer::encode_impl(std::string_view text, bool allow_special, bool post_process) const {
  if (const auto bad = first_invalid_utf8(text)) {
    throw ValueError("tokenizer.json: the text is not valid UTF-8 at byte " + std::to_string(*bad) +
                     "; fix the encoding or replace invalid bytes (--replace-invalid)");
  }
  const State& s = *state_;
  std::vector<int64_t> body;
  s.encode_text(text, allow_special, body);
  if (!post_process || !s.has_template) return body;
  std::vector<int64_t> out;
  for (int64_t item : s.template_items) {
    if (item < 0) out.insert(out.end(), body.begin(), body.end());
    else out.push_back(item);
  }
  return out;
}

namespace {
std::string decode_ids(const HfTokenizer::State& s, std::span<const int64_t> ids, bool skip_special, bool raw = false) {
  std::vector<std::string> tokens;
  tokens.reserve(ids.size());
  for (int64_t id : ids) {
    if (id < 0 || id >= s.size())
      throw ValueError("tokenizer.json: token id " + std::to_string(id) + " is outside the vocabulary [0, " +
                       std::to_string(s.size()) + ")");
    if (skip_special && s.special[static_cast<size_t>(id)]) continue;
    tokens.emplace_back(s.model.vocab.text(static_cast<int32_t>(id)));
  }
  if (s.decoder) s.decoder->apply(tokens, s.byte_of);
  std::string out;
  for (const std::string& t : tokens) out += t;
  return raw ? out : replace_invalid_utf8(out);
}
}  // namespace

std::string HfTokenizer::decode(std::span<const int64_t> ids) const { return decode_ids(*state_, ids, false); }
std::string HfTokenizer::decode_text(std::span<const int64_t> ids) const { return decode_ids(*state_, ids, true); }
std::string HfTokenizer::token_bytes(int64_t id) const {
  return decode_ids(*state_, std::span<const int64_t>(&id, 1), false, true);
}
int64_t HfTokenizer::vocab_size() const { return state_->size(); }
std::string HfTokenizer::name() const { return state_->kind; }
int64_t HfTokenizer::end_of_text() const { return state_->eos; }
int64_t HfTokenizer::bos_id() const { return state_->bos; }
int64_t HfTokenizer::pad_id() const { return state_->pad; }
int64_t HfTokenizer::token_id(std::string_view token) const { return state_->id_of(token); }
bool HfTokenizer::is_special(int64_t id) const {
  return id >= 0 && id < static_cast<int64_t>(state_->special.size()) && state_->special[static_cast<size_t>(id)];
}
const std::string& HfTokenizer::chat_template() const { return state_->chat_template; }
std::string HfTokenizer::token_content(int64_t id) const {
  if (id < 0 || id >= state_->size()) return "";
  return std::string(state_->model.vocab.text(static_cast<int32_t>(id)));
}

}  // namespace qkv::text
