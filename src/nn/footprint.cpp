// The memory estimates of qkv/nn/footprint.hpp: the book's chapter-4 bonus estimators (ch04/04_gqa, 05_mla, 06_swa,
// 07_moe) as overflow-checked integer arithmetic, and their report.
#include "qkv/nn/footprint.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <initializer_list>
#include <tuple>

#include "qkv/core/error.hpp"
#include "qkv/nn/decoder.hpp"

namespace qkv::nn {

namespace {

// a·b·…, or ValueError naming what overflowed.
int64_t product(std::initializer_list<int64_t> factors, const char* what) {
  int64_t n = 1;
  for (int64_t f : factors)
    if (__builtin_mul_overflow(n, f, &n)) throw ValueError(std::string("memory: ") + what + " overflows 64 bits; use smaller settings");
  return n;
}
int64_t sum(int64_t a, int64_t b, const char* what) {
  int64_t n = 0;
  if (__builtin_add_overflow(a, b, &n)) throw ValueError(std::string("memory: ") + what + " overflows 64 bits; use smaller settings");
  return n;
}

// 1234567 → "1,234,567"
std::string thousands(int64_t n) {
  std::string digits = std::to_string(n < 0 ? -n : n), out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return n < 0 ? "-" + out : out;
}

void require(bool ok, const std::string& what) {
  if (!ok) throw ValueError("memory: " + what);
}

}  // namespace

void MemorySettings::validate() const {
  require(batch >= 1, "batch must be at least 1, got " + std::to_string(batch));
  require(emb_dim >= 1, "emb_dim must be at least 1, got " + std::to_string(emb_dim));
  require(heads >= 0, "heads must not be negative (0: no KV-cache lines)");
  require(heads > 0 || hidden_dim > 0, "give heads (the KV cache) or hidden_dim (the MoE), or both");
  if (heads > 0) {
    require(context >= 1, "context must be at least 1 token, got " + std::to_string(context));
    require(layers >= 1, "layers must be at least 1, got " + std::to_string(layers));
    require(kv_groups >= 1 && heads % kv_groups == 0,
            "kv_groups = " + std::to_string(kv_groups) + " must divide heads = " + std::to_string(heads));
  }
  require(bytes_per_value >= 1 && bytes_per_value <= 8, "bytes per value must be 1, 2, 4 or 8");
  require(latent_dim >= 0, "latent_dim must not be negative (0: no MLA)");
  require(window >= 0, "window must not be negative (0: no sliding window)");
  require(swa_layers >= 0 && full_layers >= 0 && swa_layers + full_layers > 0,
          "the sliding:full ratio a:b needs a, b ≥ 0 and a + b > 0");
  require(hidden_dim >= 0, "hidden_dim must not be negative (0: no MoE section)");
  if (hidden_dim > 0) {
    require(ffn_matrices == 2 || ffn_matrices == 3, "the FFN has 2 (GELU) or 3 (SwiGLU) matrices");
    require(experts >= 1, "experts must be at least 1 with hidden_dim set");
    require(top_k >= 1 && top_k <= experts,
            "top_k = " + std::to_string(top_k) + " must lie in 1…experts (" + std::to_string(experts) + ")");
  }
}

int64_t kv_cache_bytes(int64_t batch, int64_t tokens, int64_t head_dim, int64_t kv_heads, int64_t layers,
                       int64_t bytes_per_value) {
  return product({batch, tokens, head_dim, kv_heads, 2, bytes_per_value, layers}, "the KV cache's bytes");
}

int64_t latent_cache_bytes(int64_t batch, int64_t tokens, int64_t layers, int64_t latent_dim, int64_t bytes_per_value) {
  return product({batch, tokens, layers, latent_dim, bytes_per_value}, "the latent cache's bytes");
}

std::pair<int64_t, int64_t> split_sliding_layers(int64_t layers, int64_t a, int64_t b) {
  const int64_t block = a + b, blocks = layers / block, rest = layers % block;
  return {blocks * a + std::min(a, rest), blocks * b + std::max<int64_t>(0, rest - a)};
}

namespace {
void attention_figures(const MemorySettings& s, MemoryFigures& f);
void expert_figures(const MemorySettings& s, MemoryFigures& f);
}  // namespace

MemoryFigures memory_figures(const MemorySettings& s) {
  s.validate();
  MemoryFigures f;
  if (s.heads > 0) attention_figures(s, f);
  if (s.hidden_dim > 0) expert_figures(s, f);
  return f;
}

namespace {
void attention_figures(const MemorySettings& s, MemoryFigures& f) {
  f.head_dim = (s.emb_dim + s.heads - 1) / s.heads;  // the book's math.ceil(emb_dim / n_heads)
  f.kv_heads_gqa = s.heads / s.kv_groups;
  f.mha_bytes = kv_cache_bytes(s.batch, s.context, f.head_dim, s.heads, s.layers, s.bytes_per_value);
  f.gqa_bytes = kv_cache_bytes(s.batch, s.context, f.head_dim, f.kv_heads_gqa, s.layers, s.bytes_per_value);
  if (s.latent_dim > 0) f.mla_bytes = latent_cache_bytes(s.batch, s.context, s.layers, s.latent_dim, s.bytes_per_value);
  if (s.window > 0) {
    std::tie(f.sliding_layers, f.full_layers) = split_sliding_layers(s.layers, s.swa_layers, s.full_layers);
    const int64_t cached = std::min(s.context, s.window);
    for (auto [kv_heads, total] : {std::pair{s.heads, &f.mha_swa_bytes}, {f.kv_heads_gqa, &f.gqa_swa_bytes}})
      *total = sum(kv_cache_bytes(s.batch, cached, f.head_dim, kv_heads, f.sliding_layers, s.bytes_per_value),
                   kv_cache_bytes(s.batch, s.context, f.head_dim, kv_heads, f.full_layers, s.bytes_per_value),
                   "the KV cache's bytes");
  }
}

void expert_figures(const MemorySettings& s, MemoryFigures& f) {
  f.dense_params = product({s.ffn_matrices, s.emb_dim, s.hidden_dim}, "the dense FFN's parameters");
  f.router_params = product({s.emb_dim, s.experts}, "the router's parameters");
  f.expert_hidden = s.hidden_dim;
  if (s.match_dense) {
    // The book's round(num / den) in double: (dense − router) / (experts · matrices · emb).
    const int64_t num = f.dense_params - f.router_params;
    require(num > 0, "the dense FFN is too small for " + std::to_string(s.experts) + " experts' router");
    const double den = static_cast<double>(product({s.experts, s.ffn_matrices, s.emb_dim}, "the expert split"));
    f.expert_hidden = static_cast<int64_t>(std::nearbyint(static_cast<double>(num) / den));  // ties to even, as Python
  }
  f.per_expert_params = product({s.ffn_matrices, s.emb_dim, f.expert_hidden}, "an expert's parameters");
  f.moe_params = sum(product({s.experts, f.per_expert_params}, "the experts' parameters"), f.router_params, "the MoE's parameters");
  f.moe_active_params = sum(product({s.top_k, f.per_expert_params}, "the active parameters"), f.router_params, "the active parameters");
}
}  // namespace

std::string gigabytes(int64_t bytes) {
  char buffer[64];
  std::snprintf(buffer, sizeof buffer, "%.2f GB", static_cast<double>(bytes) / 1e9);
  std::string digits = buffer;  // the book's f"{gb:,.2f}": thousands separators in the whole part
  const size_t dot = digits.find('.');
  return thousands(std::stoll(digits.substr(0, dot))) + digits.substr(dot);
}

namespace {
// "  label<padding>value": labels are ASCII, padded to 26 columns
void line(std::string& out, const std::string& label, const std::string& value) {
  out += "  " + label + std::string(label.size() < 26 ? 26 - label.size() : 1, ' ') + value + "\n";
}

void attention_lines(const MemorySettings& s, const MemoryFigures& f, std::string& out) {
  out += "  batch " + std::to_string(s.batch) + ", context " + thousands(s.context) + ", emb " + thousands(s.emb_dim) +
         ", " + std::to_string(s.heads) + " heads of " + std::to_string(f.head_dim) + ", " + std::to_string(s.layers) +
         " layers, " + std::to_string(s.kv_groups) + " KV groups (" + std::to_string(f.kv_heads_gqa) + " K/V heads), " +
         std::to_string(s.bytes_per_value) + " bytes a value\n";
  line(out, "MHA KV cache", gigabytes(f.mha_bytes));
  line(out, "GQA KV cache", gigabytes(f.gqa_bytes));
  if (s.latent_dim > 0) line(out, "MLA latent cache (" + std::to_string(s.latent_dim) + ")", gigabytes(f.mla_bytes));
  if (s.window > 0) {
    const std::string ratio = std::to_string(s.swa_layers) + ":" + std::to_string(s.full_layers);
    out += "  sliding window " + thousands(s.window) + ", " + ratio + " → " + std::to_string(f.sliding_layers) +
           " sliding and " + std::to_string(f.full_layers) + " full layers\n";
    line(out, "MHA + SWA KV cache", gigabytes(f.mha_swa_bytes));
    line(out, "GQA + SWA KV cache", gigabytes(f.gqa_swa_bytes));
  }
}

void expert_lines(const MemorySettings& s, const MemoryFigures& f, std::string& out) {
  out += "  FFN: emb " + thousands(s.emb_dim) + ", hidden " + thousands(s.hidden_dim) +
         (s.ffn_matrices == 3 ? ", SwiGLU" : ", GELU") + "; " + std::to_string(s.experts) + " experts, top-" +
         std::to_string(s.top_k) + ", expert hidden " + thousands(f.expert_hidden) +
         (s.match_dense ? " (matched to the dense FFN)" : "") + "\n";
  auto params = [&](int64_t n) { return thousands(n) + " (" + gigabytes(product({n, s.bytes_per_value}, "the bytes")) + ")"; };
  line(out, "dense FFN parameters", params(f.dense_params));
  line(out, "per expert", params(f.per_expert_params));
  line(out, "router", params(f.router_params));
  line(out, "MoE parameters", params(f.moe_params));
  line(out, "MoE active per token", params(f.moe_active_params));
}
}  // namespace

std::string memory_report(const MemorySettings& s) {
  const MemoryFigures f = memory_figures(s);
  std::string out;
  if (!s.title.empty()) out += s.title + "\n";
  if (s.heads > 0) attention_lines(s, f, out);
  if (s.hidden_dim > 0) expert_lines(s, f, out);
  return out;
}

std::vector<MemorySettings> book_memory_settings() {
  std::vector<MemorySettings> all;
  MemorySettings gqa;
  gqa.title = "GQA (the book's ch04/04_gqa)";
  gqa.context = 32768;
  gqa.emb_dim = 4096;
  gqa.heads = 32;
  gqa.layers = 32;
  gqa.kv_groups = 4;
  all.push_back(gqa);
  MemorySettings mla;
  mla.title = "MLA (ch04/05_mla)";
  mla.context = 8192;
  mla.emb_dim = 2048;
  mla.heads = 24;
  mla.layers = 48;
  mla.kv_groups = 4;
  mla.latent_dim = 1024;
  all.push_back(mla);
  MemorySettings swa = gqa;
  swa.title = "SWA (ch04/06_swa)";
  swa.window = 1024;
  swa.swa_layers = 5;
  swa.full_layers = 1;
  all.push_back(swa);
  MemorySettings moe;  // the MoE estimator counts parameters only: no attention lines
  moe.heads = 0;
  moe.title = "MoE (ch04/07_moe)";
  moe.emb_dim = 7168;
  moe.hidden_dim = 14336;
  moe.ffn_matrices = 3;
  moe.experts = 8;
  moe.top_k = 2;
  all.push_back(moe);
  return all;
}

std::string memory_report(const DecoderConfig& config, int64_t batch, int64_t context, int64_t bytes_per_value) {
  config.validate();
  require(batch >= 1 && context >= 1, "batch and context must be at least 1");
  require(bytes_per_value >= 1 && bytes_per_value <= 8, "bytes per value must be 1, 2, 4 or 8");
  // Active per token: the experts a token does not use are left out (k of E in each mixture-of-experts layer).
  const int64_t total_params = config.parameter_count();
  int64_t idle = 0;
  for (const DecoderLayerSettings& layer : config.layers)
    if (layer.experts)
      idle += (config.num_experts - config.experts_per_token) *
              (3 * config.expert_intermediate_size * config.hidden_size +
               (config.family->stacked_experts ? 2 * config.expert_intermediate_size + config.hidden_size : 0));  // gpt-oss's biases
  const std::string active = idle > 0 ? " (" + thousands(total_params - idle) + " active per token)" : "";
  std::string out = config.family->description + ": " + thousands(total_params) + " parameters" + active + "; " +
                    std::to_string(config.num_layers) + " layers, " + std::to_string(config.num_heads) + " heads of " +
                    std::to_string(config.head_dim) + ", " + std::to_string(config.num_kv_heads) + " K/V heads" +
                    (config.latent() ? "; latent attention caches " + std::to_string(config.kv_lora_rank) + " + " +
                                           std::to_string(config.head_dim) + " values a token and layer"
                                     : std::string()) + "\n";
  out += "  KV cache for batch " + std::to_string(batch) + " × " + thousands(context) + " tokens, " +
         std::to_string(bytes_per_value) + " bytes a value:\n";
  // layers grouped by the tokens they cache: full layers, then each window
  std::vector<std::pair<int64_t, int64_t>> kinds;  // (window, layers)
  int64_t linear_layers = 0;
  for (const DecoderLayerSettings& layer : config.layers) {
    if (layer.linear) {
      ++linear_layers;
      continue;
    }
    auto it = std::find_if(kinds.begin(), kinds.end(), [&](const auto& k) { return k.first == layer.window; });
    if (it == kinds.end()) kinds.push_back({layer.window, 1});
    else ++it->second;
  }
  int64_t total = 0;
  for (const auto& [window, layers] : kinds) {
    const int64_t tokens = window > 0 ? std::min(context, window) : context;
    // latent attention caches one latent (kv_lora_rank) and one rotated key (qk_rope_head_dim) a token, not K and V
    const int64_t bytes =
        config.latent() ? product({batch, tokens, config.kv_lora_rank + config.head_dim, bytes_per_value, layers}, "the KV cache's bytes")
                        : kv_cache_bytes(batch, tokens, config.head_dim, config.num_kv_heads, layers, bytes_per_value);
    total = sum(total, bytes, "the KV cache's bytes");
    line(out, std::to_string(layers) + (window > 0 ? " sliding (" + thousands(window) + ")" : " full") + " layers",
         gigabytes(bytes) + " (" + thousands(bytes) + " bytes)");
  }
  if (linear_layers > 0) {  // Gated DeltaNet: a float32 (Dk × Dv) state per value head and the conv's last K − 1
                           // inputs, whatever the context
    const int64_t bytes = product({batch, linear_layers, config.linear_state_floats(), 4}, "the Gated DeltaNet states' bytes");
    total = sum(total, bytes, "the KV cache's bytes");
    line(out, std::to_string(linear_layers) + " Gated DeltaNet layers",
         gigabytes(bytes) + " (" + thousands(bytes) + " bytes: states, the same for any context)");
  }
  line(out, "total", gigabytes(total) + " (" + thousands(total) + " bytes)");
  return out;
}

}  // namespace qkv::nn
