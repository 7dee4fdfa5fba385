// The book's attention classes by Python name, built from string arguments (safetensors metadata).
#include <string>

#include "qkv/core/settings.hpp"
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
  // The same checked parsers as every other setting (qkv/core/settings.hpp).
  int64_t integer(const std::string& key) const { return parse_int(text(key), "module argument " + key); }
  double real(const std::string& key) const { return parse_real(text(key), "module argument " + key); }
  bool flag(const std::string& key, bool fallback) const {
    auto it = values_.find(key);
    return it == values_.end() ? fallback : parse_bool(it->second, "module argument " + key);
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

int64_t attention_parameter_count(const std::map<std::string, std::string>& arguments) {
  const Arguments a(arguments);
  const std::string& kind = a.text("module");
  auto product = [](std::initializer_list<int64_t> factors) {
    int64_t n = 1;
    for (int64_t f : factors)
      if (f < 0 || __builtin_mul_overflow(n, f, &n) || n > kMaxElements)
        throw ValueError("module arguments describe more parameters than any machine holds");
    return n;
  };
  const int64_t d_in = a.integer("d_in"), d_out = a.integer("d_out");
  const int64_t bias = a.flag("qkv_bias", false) ? d_out : 0;
  const int64_t projections = 3 * product({d_in, d_out}) + 3 * bias;  // Wq, Wk, Wv
  if (kind == "SelfAttention_v1") return 3 * product({d_in, d_out});
  if (kind == "SelfAttention_v2" || kind == "CausalAttention") return projections;
  if (kind == "MultiHeadAttentionWrapper") return product({a.integer("num_heads"), projections});
  if (kind == "MultiHeadAttention") return projections + product({d_out, d_out}) + d_out;
  return 0;  // unknown: make_attention_module says so
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
