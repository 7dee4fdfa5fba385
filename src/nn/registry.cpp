// The book's attention classes by Python name, built from string arguments (safetensors metadata).
#include <cstdlib>
#include <string>

#include "qkv/nn/attention.hpp"

namespace qkv::nn {

namespace {

class Arguments {
 public:
  explicit Arguments(const std::map<std::string, std::string>& values) : values_(values) {}

  const std::string& text(const std::string& key) const {
    auto it = values_.find(key);
    if (it == values_.end()) throw ValueError("module metadata lacks the argument \"" + key + "\"");
    return it->second;
  }
  int64_t integer(const std::string& key) const {
    const std::string& v = text(key);
    char* end = nullptr;
    const long long n = std::strtoll(v.c_str(), &end, 10);
    if (v.empty() || *end != '\0') throw ValueError("module argument \"" + key + "\" = \"" + v + "\" is not an integer");
    return n;
  }
  double real(const std::string& key) const {
    const std::string& v = text(key);
    char* end = nullptr;
    const double x = std::strtod(v.c_str(), &end);
    if (v.empty() || *end != '\0') throw ValueError("module argument \"" + key + "\" = \"" + v + "\" is not a number");
    return x;
  }
  bool flag(const std::string& key, bool fallback) const {
    auto it = values_.find(key);
    if (it == values_.end()) return fallback;
    const std::string& v = it->second;
    if (v == "true" || v == "True" || v == "1") return true;
    if (v == "false" || v == "False" || v == "0") return false;
    throw ValueError("module argument \"" + key + "\" = \"" + v + "\" is not true or false");
  }

 private:
  const std::map<std::string, std::string>& values_;
};

}  // namespace

const std::vector<std::string>& attention_module_names() {
  static const std::vector<std::string> names = {"SelfAttention_v1", "SelfAttention_v2", "CausalAttention",
                                                 "MultiHeadAttentionWrapper", "MultiHeadAttention"};
  return names;
}

std::unique_ptr<UnaryModule> make_attention_module(const std::map<std::string, std::string>& arguments,
                                                   Generator& gen) {
  const Arguments a(arguments);
  const std::string& kind = a.text("module");
  if (kind == "SelfAttention_v1") return std::make_unique<SelfAttentionV1>(a.integer("d_in"), a.integer("d_out"), gen);
  if (kind == "SelfAttention_v2") {
    return std::make_unique<SelfAttentionV2>(a.integer("d_in"), a.integer("d_out"), a.flag("qkv_bias", false), gen);
  }
  if (kind == "CausalAttention") {
    return std::make_unique<CausalAttention>(a.integer("d_in"), a.integer("d_out"), a.integer("context_length"),
                                             a.real("dropout"), a.flag("qkv_bias", false), gen);
  }
  if (kind == "MultiHeadAttentionWrapper") {
    return std::make_unique<MultiHeadAttentionWrapper>(a.integer("d_in"), a.integer("d_out"),
                                                       a.integer("context_length"), a.real("dropout"),
                                                       a.integer("num_heads"), a.flag("qkv_bias", false), gen);
  }
  if (kind == "MultiHeadAttention") {
    return std::make_unique<MultiHeadAttention>(a.integer("d_in"), a.integer("d_out"), a.integer("context_length"),
                                                a.real("dropout"), a.integer("num_heads"), a.flag("qkv_bias", false),
                                                gen);
  }
  std::string known;
  for (const auto& n : attention_module_names()) known += (known.empty() ? "" : ", ") + n;
  throw ValueError("unknown module \"" + kind + "\"; expected one of " + known);
}

}  // namespace qkv::nn
