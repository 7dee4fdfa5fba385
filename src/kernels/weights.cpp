// Products with stored weights (see qkv/kernels/weights.hpp): the streaming one-row path (integer dots of
// quant_dot.cpp, or 16-bit floats widened in the loop), the panel path (W widened to float32 a panel at a time, then
// sgemm) and the backward, beside their double-precision references.
#include "qkv/kernels/weights.hpp"

#include <omp.h>

#include <algorithm>
#include <span>
#include <string>
#include <vector>

#include "qkv/kernels/gemm.hpp"
#include "qkv/kernels/memory.hpp"
#include "quant_dot.hpp"

namespace qkv::kernels {

namespace {

// Rows of W widened per panel of the many-row path: the panel (kPanelRows × K floats, 512 KiB at K = 1024) stays in
// the L2 cache while sgemm packs it, and sgemm's own packing of X is spread over enough columns.
constexpr int64_t kPanelRows = 128;
// Multiply-adds below which one thread does the whole product: a parallel region costs more (gemm()'s 2·10⁶).
constexpr int64_t kParallelProduct = int64_t{1} << 21;

const unsigned char* row_at(const WeightView& w, int64_t n, int64_t bytes) {
  return static_cast<const unsigned char*>(w.data) + n * bytes;
}

int team() { return omp_in_parallel() ? 1 : omp_get_max_threads(); }

// Quantized activations of the calling thread, kept between calls (generation calls this hundreds of times a token).
std::vector<quant::ActivationRow>& activation_rows() {
  thread_local std::vector<quant::ActivationRow> rows;
  return rows;
}

// Few rows: every row of W read once, in order; each of its blocks unpacked once for up to 4 rows of X
// (quant::dot_rows). Threads own contiguous slices of W's rows, so each reads one sequential stream. More than 4 rows
// (prompts, batches) go 16 rows of W at a time, which stay in the L1 cache while every group of 4 rows of X passes over
// them — except where quant::takes_all_rows (Q4_0, Q8_0, Q4_K and Q5_K with AVX-512 VNNI or AVX2): that kernel is given
// every row of X and walks W a tile of kLanesTileRows rows at a time itself (one per vector lane; for few rows of X,
// Q4_0 and Q8_0 one row of W after another), and the slices are whole tiles. A row of Y is computed by the same
// arithmetic in the same order whichever group of 4 its row of X falls in, however many rows of X there are and
// however the rows of W are split between threads. W may come in parts of one type and width (a layer's q, k and v, or gate and up), their
// rows taken as one matrix's: one parallel region and one quantization of X for all.
void streaming_rows(std::span<const WeightView> parts, int64_t M, const float* X, int64_t ldx, float beta, float* Y,
                    int64_t ldy) {
  const WeightType type = parts.front().type;
  const int64_t K = parts.front().cols, bytes = row_bytes(type, K);
  int64_t N = 0;
  for (const WeightView& w : parts) N += w.rows;
  const bool blocks = is_block_quantized(type);
  // Nothing here allocates after the first call with this many rows: a product of a small matrix takes ~20 µs, and a
  // heap allocation and a serialised OpenMP region per call cost ~1 µs of it (perf, a 1024 × 1024 Q4_0 product).
  std::vector<quant::ActivationRow>& acts = activation_rows();
  thread_local std::vector<const quant::ActivationRow*> act_rows;
  thread_local std::vector<const float*> x_rows;
  act_rows.clear();
  x_rows.clear();
  if (blocks) {
    if (static_cast<int64_t>(acts.size()) < M) acts.resize(static_cast<size_t>(M));
    for (int64_t m = 0; m < M; ++m) acts[m].quantize(type, X + m * ldx, K);
    for (int64_t m = 0; m < M; ++m) act_rows.push_back(&acts[m]);
  } else {
    for (int64_t m = 0; m < M; ++m) x_rows.push_back(X + m * ldx);
  }
  const quant::ActivationRow* const* act = act_rows.data();
  const float* const* xs = x_rows.data();
  // Rows [n0, n0 + count) of the whole, which may span parts: each part's piece in one call
  auto rows = [&](int64_t n0, int64_t count, int64_t m0, int64_t m_count) {
    int64_t base = 0;  // the whole's row where this part starts
    for (const WeightView& w : parts) {
      const int64_t from = std::max(n0, base), to = std::min(n0 + count, base + w.rows);
      if (from < to) {
        const unsigned char* at = row_at(w, from - base, bytes);
        float* y = Y + m0 * ldy + from;
        if (blocks) quant::dot_rows(at, bytes, to - from, act + m0, static_cast<int>(m_count), beta, y, ldy);
        else quant::dot_rows_16bit(type, at, bytes, to - from, xs + m0, static_cast<int>(m_count), K, beta, y, ldy);
      }
      base += w.rows;
    }
  };
  auto slice_rows = [&](int64_t first, int64_t count) {
    if (count <= 0) return;
    if (M <= quant::kMaxDotRows || (blocks && quant::takes_all_rows(type))) {
      rows(first, count, 0, M);
      return;
    }
    constexpr int64_t kTile = 16;
    for (int64_t n0 = first; n0 < first + count; n0 += kTile)
      for (int64_t m0 = 0; m0 < M; m0 += quant::kMaxDotRows)
        rows(n0, std::min(kTile, first + count - n0), m0, std::min<int64_t>(quant::kMaxDotRows, M - m0));
  };
  // Memory-bound for few rows: worth splitting once W is beyond a few hundred KiB, as gemm()'s one-row path; for many
  // rows once the products are worth a parallel region.
  const int parts_count = N * bytes < (int64_t{1} << 17) && M * N * K < kParallelProduct ? 1 : team();
  if (parts_count == 1) {
    slice_rows(0, N);
    return;
  }
  // the lanes' tiles are kLanesTileRows rows of W: slices of whole tiles leave a partial one only at the end
  const int64_t unit = blocks && quant::takes_all_rows(type) ? quant::kLanesTileRows : 1;
  const int64_t slice = ((N + parts_count - 1) / parts_count + unit - 1) / unit * unit;
#pragma omp parallel for num_threads(parts_count) schedule(static)
  for (int64_t p = 0; p < parts_count; ++p) slice_rows(p * slice, std::min(N, p * slice + slice) - p * slice);
}

void streaming_rows(const WeightView& w, int64_t M, const float* X, int64_t ldx, float beta, float* Y, int64_t ldy) {
  streaming_rows(std::span<const WeightView>(&w, 1), M, X, ldx, beta, Y, ldy);
}

// Many rows: threads own slices of W's rows (Y's columns); each widens its slice kPanelRows rows at a time into its own
// float32 panel and multiplies X by it with sgemm (one thread each: gemm() runs inside the parallel region as one).
// Why not integer tiles: at M = 512 on Qwen3-0.6B's shapes (bench/quant_bench.cpp, one thread of a Zen 5) the panels
// ran at 0.7–1.0× float32 sgemm (the widening is one pass over W for 512 rows of products), the streaming integer path
// at 0.7–1.4× the panels: slower for Q8_0 (0.7–0.8×), Q4_K and Q5_K (0.7–1.2×), faster only for Q6_K (1.0–1.4×) and
// some Q4_0 shapes. sgemm's register tiles reuse every loaded value ~16 times, the integer dots once per 4 rows, and
// their per-block scales and unpacking cost as much as the products. The panels also keep the activations in float32.
// An integer GEMM with the rows of W in the lanes does beat sgemm: the tiles of Q4_0, Q8_0, Q4_K and Q5_K
// (quant_lanes.cpp). Q6_K still takes the path above.
void panel_rows(const WeightView& w, int64_t M, const float* X, int64_t ldx, float beta, float* Y, int64_t ldy) {
  const int64_t N = w.rows, K = w.cols, bytes = row_bytes(w.type, K);
  const int parts = M * N * K < kParallelProduct ? 1 : static_cast<int>(std::min<int64_t>(team(), (N + 15) / 16));
  const int64_t slice = (N + parts - 1) / parts;
#pragma omp parallel num_threads(parts) if (parts > 1)
  {
    memory::Buffer<float> panel(static_cast<size_t>(std::min(kPanelRows, slice) * K));
    const int64_t p = omp_get_thread_num(), first = p * slice, end = std::min(N, first + slice);
    for (int64_t n0 = first; n0 < end; n0 += kPanelRows) {
      const int64_t rows = std::min(kPanelRows, end - n0);
      dequantize_rows(w.type, row_at(w, n0, bytes), panel.data(), rows, K);
      gemm(false, true, M, rows, K, 1.0f, X, ldx, panel.data(), K, beta, Y + n0, ldy);
    }
  }
}

}  // namespace

const char* gemm_weight_backend(WeightType type) {
  static thread_local std::string name;
  if (type == WeightType::F32) name = std::string("float32 sgemm (") + gemm_backend() + ")";
  else if (quant::takes_all_rows(type) && (type == WeightType::Q4_K || type == WeightType::Q5_K))
    name = "integer dots against 8-bit activations, " + std::to_string(quant::kLanesTileRows) +
           " rows of W across a vector's lanes (one row at a time for fewer than " + std::to_string(quant::kKTileRows) +
           " rows of X), a chain of scaled sums and one of mins: " + quant::dot_backend();
  else if (quant::takes_all_rows(type))
    name = "integer dots against 8-bit activations, " + std::to_string(quant::kLanesTileRows) +
           " rows of W across a vector's lanes (one row at a time for up to " + std::to_string(quant::kLanesDirectRows) +
           " rows of X), blocks in " + std::to_string(quant::kLanesChains) + " chains: " + quant::dot_backend();
  else if (is_block_quantized(type))
    name = std::string("integer dots against 8-bit activations: ") + quant::dot_backend();
  else
    name = "16-bit floats widened in the loop (vcvtph2ps / shift), float32 FMA";
  return name.c_str();
}

void gemm_weight(const WeightView& w, int64_t M, const float* X, int64_t ldx, float beta, float* Y, int64_t ldy) {
  (void)row_bytes(w.type, w.cols);  // checks K against the block
  if (M <= 0 || w.rows <= 0) return;
  if (w.type == WeightType::F32) {
    gemm(false, true, M, w.rows, w.cols, 1.0f, X, ldx, static_cast<const float*>(w.data), w.cols, beta, Y, ldy);
    return;
  }
  if (w.cols == 0) {  // the empty sum
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < w.rows; ++n) Y[m * ldy + n] = beta == 0.0f ? 0.0f : beta * Y[m * ldy + n];
    return;
  }
  // One arithmetic for every M: a row's result is the same alone, in a batch of 8 or in a 512-token prompt, so
  // batched generation equals solo generation token for token. The panels (widened W, sgemm) were faster from ~128
  // rows on for some types (see panel_rows); they remain for callers that ask for them (gemm_weight_panels).
  streaming_rows(w, M, X, ldx, beta, Y, ldy);
}

void gemm_weights(std::span<const WeightView> parts, int64_t M, const float* X, int64_t ldx, float beta, float* Y,
                  int64_t ldy) {
  if (parts.empty() || M <= 0) return;
  bool one_stream = parts.front().type != WeightType::F32 && parts.front().cols > 0;
  for (const WeightView& w : parts) {
    (void)row_bytes(w.type, w.cols);  // checks K against the block
    one_stream = one_stream && w.type == parts.front().type && w.cols == parts.front().cols;
  }
  if (!one_stream) {
    for (int64_t column = 0; const WeightView& w : parts) {
      gemm_weight(w, M, X, ldx, beta, Y + column, ldy);
      column += w.rows;
    }
    return;
  }
  streaming_rows(parts, M, X, ldx, beta, Y, ldy);
}

void gemm_weight_streaming(const WeightView& w, int64_t M, const float* X, int64_t ldx, float beta, float* Y, int64_t ldy) {
  if (M > 0 && w.rows > 0 && w.cols > 0 && w.type != WeightType::F32) streaming_rows(w, M, X, ldx, beta, Y, ldy);
}

void gemm_weight_panels(const WeightView& w, int64_t M, const float* X, int64_t ldx, float beta, float* Y, int64_t ldy) {
  if (M > 0 && w.rows > 0 && w.cols > 0 && w.type != WeightType::F32) panel_rows(w, M, X, ldx, beta, Y, ldy);
}

void gemm_weight_backward(const WeightView& w, int64_t M, const float* dY, int64_t ldy, float beta, float* dX, int64_t ldx) {
  const int64_t N = w.rows, K = w.cols, bytes = row_bytes(w.type, K);
  if (M <= 0 || K <= 0) return;
  if (w.type == WeightType::F32) {
    gemm(false, false, M, K, N, 1.0f, dY, ldy, static_cast<const float*>(w.data), K, beta, dX, ldx);
    return;
  }
  if (N == 0) {
    for (int64_t m = 0; m < M; ++m)
      for (int64_t k = 0; k < K; ++k) dX[m * ldx + k] = beta == 0.0f ? 0.0f : beta * dX[m * ldx + k];
    return;
  }
  // Threads own whole blocks of dX's columns (each widens only its columns of W), or rows of dX when there are fewer
  // blocks than threads (each then widens all of W: the product, M·N·K, dwarfs it once M is large).
  const int64_t block = weight_type_info(w.type).block_elements, blocks = K / block, block_bytes = weight_type_info(w.type).block_bytes;
  const int threads = M * N * K < kParallelProduct ? 1 : team();
  const bool by_columns = blocks >= threads;
  const int parts = by_columns ? threads : static_cast<int>(std::min<int64_t>(threads, M));
#pragma omp parallel num_threads(parts) if (parts > 1)
  {
    const int64_t p = omp_get_thread_num();
    const int64_t b0 = by_columns ? blocks * p / parts : 0, b1 = by_columns ? blocks * (p + 1) / parts : blocks;
    const int64_t m0 = by_columns ? 0 : M * p / parts, m1 = by_columns ? M : M * (p + 1) / parts;
    const int64_t k0 = b0 * block, width = (b1 - b0) * block;
    if (width > 0 && m1 > m0) {
      memory::Buffer<float> panel(static_cast<size_t>(std::min(kPanelRows, N) * width));
      for (int64_t n0 = 0; n0 < N; n0 += kPanelRows) {
        const int64_t rows = std::min(kPanelRows, N - n0);
        for (int64_t r = 0; r < rows; ++r)
          dequantize_rows(w.type, row_at(w, n0 + r, bytes) + b0 * block_bytes, panel.data() + r * width, 1, width);
        gemm(false, false, m1 - m0, width, rows, 1.0f, dY + m0 * ldy + n0, ldy, panel.data(), width,
             n0 == 0 ? beta : 1.0f, dX + m0 * ldx + k0, ldx);
      }
    }
  }
}

void gemm_weight_reference(const WeightView& w, int64_t M, const float* X, int64_t ldx, float beta, float* Y, int64_t ldy) {
  const int64_t N = w.rows, K = w.cols, bytes = row_bytes(w.type, K);
  std::vector<float> row(static_cast<size_t>(K));
  for (int64_t n = 0; n < N; ++n) {
    dequantize_rows(w.type, row_at(w, n, bytes), row.data(), 1, K);
    for (int64_t m = 0; m < M; ++m) {
      double acc = 0.0;
      for (int64_t k = 0; k < K; ++k) acc += static_cast<double>(row[k]) * X[m * ldx + k];
      float& out = Y[m * ldy + n];
      out = static_cast<float>(acc) + (beta == 0.0f ? 0.0f : beta * out);
    }
  }
}

void gemm_weight_backward_reference(const WeightView& w, int64_t M, const float* dY, int64_t ldy, float beta, float* dX,
                                    int64_t ldx) {
  const int64_t N = w.rows, K = w.cols, bytes = row_bytes(w.type, K);
  std::vector<float> W(static_cast<size_t>(N * K));
  if (N > 0 && K > 0) dequantize_rows(w.type, w.data, W.data(), N, K);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) {
      double acc = 0.0;
      for (int64_t n = 0; n < N; ++n) acc += static_cast<double>(dY[m * ldy + n]) * W[n * K + k];
      float& out = dX[m * ldx + k];
      out = static_cast<float>(acc) + (beta == 0.0f ? 0.0f : beta * out);
    }
  (void)bytes;
}

void gemm_weight_integer_reference(const WeightView& w, int64_t M, const float* X, int64_t ldx, float beta, float* Y,
                                   int64_t ldy) {
  if (!is_block_quantized(w.type)) {
    gemm_weight_reference(w, M, X, ldx, beta, Y, ldy);
    return;
  }
  const int64_t N = w.rows, K = w.cols, bytes = row_bytes(w.type, K);
  const int64_t act_block = weight_type_info(w.type).block_elements;  // 32 or 256: the activations' blocks match
  std::vector<float> row(static_cast<size_t>(K));
  std::vector<double> x(static_cast<size_t>(K));
  quant::ActivationRow act;
  for (int64_t m = 0; m < M; ++m) {
    act.quantize(w.type, X + m * ldx, K);
    for (int64_t k = 0; k < K; ++k) x[k] = static_cast<double>(act.block_scale(k / act_block)) * act.level(k);
    for (int64_t n = 0; n < N; ++n) {
      dequantize_rows(w.type, row_at(w, n, bytes), row.data(), 1, K);
      double acc = 0.0;
      for (int64_t k = 0; k < K; ++k) acc += static_cast<double>(row[k]) * x[k];
      float& out = Y[m * ldy + n];
      out = static_cast<float>(acc) + (beta == 0.0f ? 0.0f : beta * out);
    }
  }
}

}  // namespace qkv::kernels
