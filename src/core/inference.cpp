// Inference-only row operations for sessions (see qkv/core/inference.hpp).
#include "qkv/core/inference.hpp"

#include <omp.h>

#include <algorithm>
#include <string>
#include <vector>

#include "qkv/kernels/attention.hpp"
#include "qkv/kernels/rope.hpp"
#include "qkv/kernels/threads.hpp"

namespace qkv {

void rope_rows_(Tensor& x, const kernels::RopeTable& table, RopeLayout layout, int64_t heads, int64_t D, int64_t row0,
                int64_t rows, const int64_t* positions) {
  const int64_t W = x.size(x.rank() - 1);
  if (heads * D > W || row0 < 0 || row0 + rows > x.numel() / W) throw ShapeError("rope_rows_: rows or heads outside x");
  for (int64_t r = 0; r < rows; ++r)
    if (positions[r] < 0 || positions[r] >= table.positions)
      throw ShapeError("rope_rows_: position " + std::to_string(positions[r]) + " outside the table's " +
                       std::to_string(table.positions));
  float* p = x.data() + row0 * W;
  kernels::rope_apply_rows(table, layout, p, p, rows, positions, W, heads, D);
}

namespace {
// The kernels' options for one sequence's attention under `config` (ShapeError, naming `who`, for sinks that do not fit)
kernels::AttentionOptions attention_options(const AttentionConfig& config, const char* who) {
  kernels::AttentionOptions options;
  options.threads = omp_in_parallel() ? 1 : 0;  // one of a batch's sequences, attended beside the others
  options.causal = config.causal;
  options.window = config.window;
  options.scale = config.scale;
  options.softcap = config.softcap;
  if (config.sinks.defined()) {  // gpt-oss: one logit per head in each row's denominator
    const int64_t H = config.num_heads;
    if (!(config.sinks.shape() == Shape{H}) || config.sinks.dtype() != DType::F32)
      throw ShapeError(std::string(who) + ": sinks must be float32 of shape (" + std::to_string(H) + "), got " +
                       config.sinks.shape().str());
    options.sinks = config.sinks.data();
  }
  return options;
}
}  // namespace

void attend_rows(const Tensor& q, int64_t row0, int64_t rows, const float* keys, const float* values, int64_t Tk,
                 const AttentionConfig& config, Tensor& context) {
  const int64_t H = config.num_heads, H_kv = config.num_kv_heads > 0 ? config.num_kv_heads : H;
  const int64_t Q = q.size(q.rank() - 1), D = Q / H;
  if (Q % H != 0 || H % H_kv != 0 || rows > Tk || context.numel() != q.numel())
    throw ShapeError("attend_rows: q's width, the heads, the rows or the context do not fit");
  kernels::AttentionDims dims;
  dims.B = 1, dims.H = H, dims.Tq = rows, dims.Tk = Tk, dims.D = D, dims.H_kv = H_kv;
  kernels::AttentionLayout layout;
  layout.q = layout.o = kernels::AttentionStrides::btc(H, D, rows);
  layout.k = layout.v = kernels::AttentionStrides::btc(H_kv, D, Tk);
  const kernels::AttentionOptions options = attention_options(config, "attend_rows");
  std::vector<float> lse(static_cast<size_t>(H * rows));
  kernels::attention_forward(dims, layout, options, q.data() + row0 * Q, keys, values, context.data() + row0 * Q,
                             lse.data());
}

namespace {
// A one-row run over its pages (kernels::attention_decode)
void attend_paged(const Tensor& q, int64_t row, const PagedKV& kv, const AttentionConfig& config, Tensor& context) {
  const int64_t H = config.num_heads, H_kv = config.num_kv_heads > 0 ? config.num_kv_heads : H;
  const int64_t Q = q.size(q.rank() - 1);
  kernels::AttentionDims dims;
  dims.H = H, dims.H_kv = H_kv, dims.D = Q / H, dims.Tq = 1, dims.Tk = kernels::KVPages{kv.pages}.positions();
  const kernels::AttentionOptions options = attention_options(config, "attend_runs");  // causal, window: the pages
  kernels::attention_decode(dims, options, q.data() + row * Q, kernels::KVPages{kv.pages, kv.type, kv.row_bytes},
                            context.data() + row * Q);
}
}  // namespace

void attend_runs(const Tensor& q, std::span<const AttentionRun> runs, int64_t kv_width,
                 const std::function<void(size_t, float*, float*)>& gather, const AttentionConfig& config,
                 Tensor& context, const PageLookup& pages) {
  // A decoding step's sequences are one row each; attended one after another, each gather ran on one thread while
  // the others waited (a fifth of a batch-of-8 step on 2 threads). One long prompt keeps the threads for itself.
  constexpr int64_t kParallelRunRows = 64;
  int64_t longest = 0;
  for (const AttentionRun& run : runs) longest = std::max(longest, run.rows);
  const int64_t H = config.num_heads, Q = q.size(q.rank() - 1);
  auto attend = [&](size_t i) {
    const AttentionRun& run = runs[i];
    if (run.rows == 1 && pages) {
      thread_local PagedKV kv;
      kv.pages.clear();
      pages(i, kv);
      if (Q % H == 0 && kernels::attention_decode_supports(kv.type, Q / H)) {
        attend_paged(q, run.row0, kv, config, context);
        return;
      }
    }
    thread_local std::vector<float> keys, values;
    keys.resize(static_cast<size_t>(run.Tk * kv_width));
    values.resize(static_cast<size_t>(run.Tk * kv_width));
    gather(i, keys.data(), values.data());
    attend_rows(q, run.row0, run.rows, keys.data(), values.data(), run.Tk, config, context);
  };
  if (runs.size() > 1 && longest <= kParallelRunRows)
    parallel_for_each(static_cast<int64_t>(runs.size()), [&](int64_t i) { attend(static_cast<size_t>(i)); });
  else
    for (size_t i = 0; i < runs.size(); ++i) attend(i);
}

}  // namespace qkv
