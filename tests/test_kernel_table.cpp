// One table drives the kernel tests and one the gradient checks (ggml's test-backend-ops, gemma.cpp's count ×
// misalignment sweep): adding a kernel or an op is adding a row.
//   Kernels: every fast kernel against its scalar reference for n = 0…17 and odd sizes, at three pointer
//            misalignments (0, 1 and 3 floats past a 64-byte boundary), so vector bodies and scalar tails
//            both run.
//   Ops:     every differentiable op against central differences (the loss summed in double).
#include <cstring>
#include <deque>
#include <functional>
#include <limits>
#include <numeric>
#include <tuple>

#include "helpers.hpp"
#include "qkv/kernels.hpp"

namespace qkv::test {
namespace {

// n random floats starting `misalign` floats into a fresh buffer.
class Buffer {
 public:
  Buffer(int64_t n, int misalign, uint64_t seed, float scale = 1.0f, float shift = 0.0f)
      : storage_(static_cast<size_t>(n + 8)), data_(storage_.data() + misalign), n_(n) {
    Generator gen(seed);
    for (int64_t i = 0; i < n; ++i) data_[i] = (gen.uniform_float(-1.0f, 1.0f)) * scale + shift;
  }
  float* data() { return data_; }
  const float* data() const { return data_; }
  std::vector<float> copy() const { return {data_, data_ + n_}; }

 private:
  std::vector<float> storage_;
  float* data_;
  int64_t n_;
};

::testing::AssertionResult close(const float* got, const float* want, int64_t n, double rtol, double atol) {
  for (int64_t i = 0; i < n; ++i) {
    const double g = got[i], w = want[i];
    if (std::isnan(g) && std::isnan(w)) continue;
    if (!(std::fabs(g - w) <= atol + rtol * std::fabs(w)))
      return ::testing::AssertionFailure() << "element " << i << ": " << g << " vs reference " << w;
  }
  return ::testing::AssertionSuccess();
}

struct KernelCase {
  const char* name;
  std::function<::testing::AssertionResult(int64_t n, int misalign)> check;
};

kernels::Broadcast same_shape(int64_t rows, int64_t n) {
  kernels::Broadcast b;
  b.dims = {1, 1, rows, n};
  b.a_stride = b.b_stride = {0, 0, n, 1};
  return b;
}

// A gated delta rule's backward (the recurrent or the chunked form) against the double reference, every gradient
using kernels::DeltaRuleDims;
using DeltaBackward = void (*)(const DeltaRuleDims&, const float*, const float*, const float*, const float*, const float*,
                               const float*, const float*, float*, float*, float*, float*, float*);
::testing::AssertionResult delta_gradients_match(DeltaBackward backward, const DeltaRuleDims& d, const float* q,
                                                 const float* k, const float* v, const float* g, const float* beta,
                                                 const float* init, const float* g_out, int m) {
  const int64_t rows = d.B * d.T * d.H;
  Buffer dq(rows * d.Dk, m, 11), dk(rows * d.Dk, m, 12), dv(rows * d.Dv, m, 13), dg(rows, m, 14), db(rows, m, 15);
  Buffer rq(rows * d.Dk, m, 16), rk(rows * d.Dk, m, 17), rv(rows * d.Dv, m, 18), rg(rows, m, 19), rb(rows, m, 20);
  backward(d, q, k, v, g, beta, init, g_out, dq.data(), dk.data(), dv.data(), dg.data(), db.data());
  kernels::delta_rule_backward_reference(d, q, k, v, g, beta, init, g_out, rq.data(), rk.data(), rv.data(), rg.data(),
                                         rb.data());
  for (auto [got, want, size, what] : {std::tuple{dq.data(), rq.data(), rows * d.Dk, "dq"},
                                       {dk.data(), rk.data(), rows * d.Dk, "dk"},
                                       {dv.data(), rv.data(), rows * d.Dv, "dv"},
                                       {dg.data(), rg.data(), rows, "dg"}, {db.data(), rb.data(), rows, "dbeta"}})
    if (auto ok = close(got, want, size, 1e-3, 1e-4); !ok) return ok << " (" << what << ")";
  return ::testing::AssertionSuccess();
}

std::vector<KernelCase> kernel_cases() {
  using namespace kernels;
  std::vector<KernelCase> cases;
  cases.push_back({"softmax_rows", [](int64_t n, int m) {
                     Buffer x(3 * n, m, 1, 8.0f), y(3 * n, m, 2), r(3 * n, m, 3);
                     softmax_rows(x.data(), y.data(), 3, n);
                     softmax_rows_reference(x.data(), r.data(), 3, n);
                     return close(y.data(), r.data(), 3 * n, 1e-5, 1e-7);
                   }});
  cases.push_back({"softmax_rows_backward", [](int64_t n, int m) {
                     Buffer x(3 * n, m, 1, 4.0f), y(3 * n, m, 2), g(3 * n, m, 3), d(3 * n, m, 4);
                     softmax_rows(x.data(), y.data(), 3, n);
                     std::vector<float> want = d.copy();
                     softmax_rows_backward(y.data(), g.data(), d.data(), 3, n);
                     softmax_rows_backward_reference(y.data(), g.data(), want.data(), 3, n);
                     return close(d.data(), want.data(), 3 * n, 1e-5, 1e-6);
                   }});
  cases.push_back({"cross_entropy", [](int64_t n, int m) {
                     const int64_t V = n + 1, rows = 4;
                     Buffer z(rows * V, m, 1, 5.0f), p(rows * V, m, 2), d(rows * V, m, 3);
                     const std::vector<int64_t> targets = {0, -100, V - 1, V / 2};
                     int64_t counted = 0, bad = 0, counted_ref = 0;
                     const double loss = cross_entropy_forward(z.data(), targets.data(), p.data(), rows, V, -100, &counted, &bad);
                     const double want = cross_entropy_forward_reference(z.data(), targets.data(), rows, V, -100, &counted_ref);
                     if (bad != -1 || counted != 3 || counted_ref != 3 || std::fabs(loss - want) > 1e-5 * (1 + std::fabs(want)))
                       return ::testing::AssertionFailure() << "loss " << loss << " vs " << want;
                     std::vector<float> dwant = d.copy();
                     cross_entropy_backward(p.data(), targets.data(), d.data(), rows, V, -100, 0.25f);
                     cross_entropy_backward_reference(z.data(), targets.data(), dwant.data(), rows, V, -100, 0.25f);
                     return close(d.data(), dwant.data(), rows * V, 1e-5, 1e-6);
                   }});
  cases.push_back({"linear_cross_entropy", [](int64_t n, int m) {
                     // V = n + 1 classes, C = 5 features, 7 rows in blocks of 3 (and all at once): loss, dx, dW, db
                     const int64_t V = n + 1, C = 5, N = 7;
                     Buffer x(N * C, m, 1), w(V * C, m, 2), b(V, m, 3);
                     const std::vector<int64_t> targets = {0, -100, V - 1, V / 2, 0, V - 1, -100};
                     std::vector<float> dx_want(N * C), dw_want(V * C), db_want(V);
                     const CrossEntropySum want = linear_cross_entropy_reference(
                         x.data(), w.data(), b.data(), targets.data(), N, C, V, -100, dx_want.data(), dw_want.data(), db_want.data());
                     for (int64_t block : {3, 0}) {
                       for (const float* bias : {static_cast<const float*>(b.data()), static_cast<const float*>(nullptr)}) {
                         Buffer dx(N * C, m, 4), dw(V * C, m, 5), db(V, m, 6);
                         const CrossEntropySum got = linear_cross_entropy(x.data(), w.data(), bias, targets.data(), N, C, V,
                                                                          -100, dx.data(), dw.data(), db.data(), block);
                         const CrossEntropySum plain = linear_cross_entropy(x.data(), w.data(), bias, targets.data(), N, C, V,
                                                                            -100, nullptr, nullptr, nullptr, block);
                         if (got.counted != 5 || got.bad_row != -1 || plain.total != got.total)
                           return ::testing::AssertionFailure() << "counted " << got.counted << ", loss with/without grad "
                                                                << got.total << " / " << plain.total;
                         if (!bias) continue;  // the reference has a bias: only the no-gradient agreement above
                         if (std::fabs(got.total - want.total) > 1e-5 * (1 + std::fabs(want.total)))
                           return ::testing::AssertionFailure() << "loss " << got.total << " vs " << want.total;
                         if (auto ok = close(dx.data(), dx_want.data(), N * C, 1e-4, 1e-6); !ok) return ok << " (dx)";
                         if (auto ok = close(dw.data(), dw_want.data(), V * C, 1e-4, 1e-6); !ok) return ok << " (dweight)";
                         if (auto ok = close(db.data(), db_want.data(), V, 1e-4, 1e-6); !ok) return ok << " (dbias)";
                       }
                     }
                     const std::vector<int64_t> bad = {0, V, 0, 0, 0, 0, 0};
                     if (linear_cross_entropy(x.data(), w.data(), nullptr, bad.data(), N, C, V, -100, nullptr, nullptr,
                                              nullptr).bad_row != 1)
                       return ::testing::AssertionFailure() << "target V at row 1 not reported";
                     return ::testing::AssertionSuccess();
                   }});
  for (BinaryOp op : {BinaryOp::Add, BinaryOp::Sub, BinaryOp::Mul, BinaryOp::Div}) {
    cases.push_back({"binary", [op](int64_t n, int m) {
                       // three layouts: the same shape, a suffix (bias) and a general broadcast (column × row)
                       Broadcast suffix = same_shape(3, n), outer;
                       suffix.b_stride = {0, 0, 0, 1};
                       outer.dims = {1, 1, 3, n};
                       outer.a_stride = {0, 0, 1, 0};
                       outer.b_stride = {0, 0, 0, 1};
                       for (const Broadcast& view : {same_shape(3, n), suffix, outer}) {
                         Buffer a(3 * n, m, 1, 1.0f, 2.0f), b(3 * n, m, 2, 1.0f, 2.0f), g(3 * n, m, 3);
                         Buffer o(3 * n, m, 4), r(3 * n, m, 5), da(3 * n, m, 6), db(3 * n, m, 7);
                         binary_forward(op, view, a.data(), b.data(), o.data());
                         binary_forward_reference(op, view, a.data(), b.data(), r.data());
                         if (auto ok = close(o.data(), r.data(), 3 * n, 1e-6, 1e-7); !ok) return ok;
                         std::vector<float> da_want = da.copy(), db_want = db.copy();
                         binary_backward(op, view, a.data(), b.data(), g.data(), da.data(), db.data());
                         binary_backward_reference(op, view, a.data(), b.data(), g.data(), da_want.data(), db_want.data());
                         // a stretched operand sums up to n terms: fused multiply-adds may round differently
                         if (auto ok = close(da.data(), da_want.data(), 3 * n, 1e-5, 1e-4); !ok) return ok;
                         if (auto ok = close(db.data(), db_want.data(), 3 * n, 1e-5, 1e-4); !ok) return ok;
                         // Written, not added (accumulate false): what the gradients held (NaN here) is gone. Each
                         // holds the elements its operand has (a stretched one has fewer than the output, or more
                         // when the output is empty).
                         int64_t a_size = 1, b_size = 1;
                         for (size_t i = 0; i < 4; ++i) {
                           if (view.a_stride[i] != 0) a_size *= view.dims[i];
                           if (view.b_stride[i] != 0) b_size *= view.dims[i];
                         }
                         const float nan = std::numeric_limits<float>::quiet_NaN();
                         std::vector<float> da_fresh(static_cast<size_t>(a_size), nan), db_fresh(static_cast<size_t>(b_size), nan);
                         std::vector<float> da_zero(da_fresh.size(), 0.0f), db_zero(db_fresh.size(), 0.0f);
                         binary_backward(op, view, a.data(), b.data(), g.data(), da_fresh.data(), db_fresh.data(), false, false);
                         binary_backward_reference(op, view, a.data(), b.data(), g.data(), da_zero.data(), db_zero.data());
                         if (auto ok = close(da_fresh.data(), da_zero.data(), a_size, 1e-5, 1e-4); !ok) return ok;
                         if (auto ok = close(db_fresh.data(), db_zero.data(), b_size, 1e-5, 1e-4); !ok) return ok;
                       }
                       return ::testing::AssertionSuccess();
                     }});
  }
  cases.push_back({"unary", [](int64_t n, int m) {
                     for (UnaryOp op : {UnaryOp::AddScalar, UnaryOp::MulScalar, UnaryOp::DivScalar, UnaryOp::Neg,
                                        UnaryOp::Exp, UnaryOp::Log, UnaryOp::SoftCap, UnaryOp::Sigmoid,
                                        UnaryOp::Softplus}) {
                       Buffer x(n, m, 1, 1.0f, 2.0f), y(n, m, 2), r(n, m, 3);
                       unary_forward(op, 1.5f, x.data(), y.data(), n);
                       unary_forward_reference(op, 1.5f, x.data(), r.data(), n);
                       if (auto ok = close(y.data(), r.data(), n, 1e-6, 1e-7); !ok) return ok;
                     }
                     return ::testing::AssertionSuccess();
                   }});
  cases.push_back({"sum_middle and add_column_sums", [](int64_t n, int m) {
                     Buffer x(2 * n * 5, m, 1), o(2 * 5, m, 2), r(2 * 5, m, 3);
                     sum_middle(x.data(), o.data(), 2, n, 5);
                     sum_middle_reference(x.data(), r.data(), 2, n, 5);
                     if (auto ok = close(o.data(), r.data(), 10, 1e-5, 1e-5); !ok) return ok;
                     Buffer big(200 * n, m, 4), c(n, m, 5);
                     std::vector<float> want = c.copy();
                     add_column_sums(big.data(), c.data(), 200, n);
                     add_column_sums_reference(big.data(), want.data(), 200, n);
                     return close(c.data(), want.data(), n, 1e-5, 1e-5);
                   }});
  cases.push_back({"transpose_batched", [](int64_t n, int m) {
                     Buffer x(2 * n * 37, m, 1), y(2 * n * 37, m, 2), r(2 * n * 37, m, 3);
                     transpose_batched(x.data(), y.data(), 2, n, 37);
                     transpose_batched_reference(x.data(), r.data(), 2, n, 37);
                     return close(y.data(), r.data(), 2 * n * 37, 0, 0);
                   }});
  cases.push_back({"transpose_strided (a column slice)", [](int64_t n, int m) {
                     const int64_t rows = 37, stride = n + 5;
                     Buffer x(rows * stride, m, 1), y(n * rows, m, 2);
                     transpose_strided(x.data() + 3, rows, n, stride, y.data());
                     std::vector<float> want(static_cast<size_t>(n * rows));
                     for (int64_t r = 0; r < rows; ++r)
                       for (int64_t c = 0; c < n; ++c) want[static_cast<size_t>(c * rows + r)] = x.data()[r * stride + 3 + c];
                     return close(y.data(), want.data(), n * rows, 0, 0);
                   }});
  cases.push_back({"hashed_dropout forward and backward", [](int64_t n, int m) {
                     Buffer x(n, m, 1), y(n, m, 2), r(n, m, 3);
                     hashed_dropout(x.data(), y.data(), n, 12345, 0.3f, false);
                     hashed_dropout_reference(x.data(), r.data(), n, 12345, 0.3f, false);
                     if (auto ok = close(y.data(), r.data(), n, 0, 0); !ok) return ok;
                     // backward: the same mask, accumulated into the gradient
                     Buffer g(n, m, 4), dx(n, m, 5);
                     std::vector<float> want = dx.copy();
                     hashed_dropout(g.data(), dx.data(), n, 12345, 0.3f, true);
                     hashed_dropout_reference(g.data(), want.data(), n, 12345, 0.3f, true);
                     return close(dx.data(), want.data(), n, 1e-6, 1e-6);  // the same keeps; y + x·s may fuse
                   }});
  cases.push_back({"gelu forward and backward", [](int64_t n, int m) {
                     Buffer x(n, m, 1, 6.0f), y(n, m, 2), r(n, m, 3), g(n, m, 4), dx(n, m, 5);
                     gelu_forward(x.data(), y.data(), n);
                     gelu_reference(x.data(), r.data(), n);
                     // tanh u = 1 − 2/(e^{2u} + 1) in float: ~1e-7 absolute near 0, so y is absolute-accurate
                     if (auto ok = close(y.data(), r.data(), n, 2e-6, 1e-6); !ok) return ok;
                     std::vector<float> want = dx.copy();
                     gelu_backward(x.data(), g.data(), dx.data(), n);
                     gelu_backward_reference(x.data(), g.data(), want.data(), n);
                     if (auto ok = close(dx.data(), want.data(), n, 1e-5, 5e-6); !ok) return ok;  // 1 + t cancels for x ≪ 0
                     // Writing instead of adding: whatever dx held (NaN here) is gone.
                     std::fill_n(dx.data(), n, std::numeric_limits<float>::quiet_NaN());
                     std::fill(want.begin(), want.end(), 0.0f);
                     gelu_backward(x.data(), g.data(), dx.data(), n, /*accumulate=*/false);
                     gelu_backward_reference(x.data(), g.data(), want.data(), n);
                     return close(dx.data(), want.data(), n, 1e-5, 5e-6);
                   }});
  cases.push_back({"layer_norm forward and backward", [](int64_t n, int m) {
                     const int64_t rows = 5, C = n + 1;
                     Buffer x(rows * C, m, 1, 2.0f, 0.5f), w(C, m, 2), b(C, m, 3), y(rows * C, m, 4), r(rows * C, m, 5);
                     Buffer mean(rows, m, 6), rstd(rows, m, 7), g(rows * C, m, 8), dx(rows * C, m, 9), dw(C, m, 10), db(C, m, 11);
                     layer_norm_forward(x.data(), w.data(), b.data(), y.data(), mean.data(), rstd.data(), rows, C, 1e-5f);
                     layer_norm_forward_reference(x.data(), w.data(), b.data(), r.data(), rows, C, 1e-5f);
                     if (auto ok = close(y.data(), r.data(), rows * C, 1e-4, 1e-5); !ok) return ok;
                     std::vector<float> dx_want = dx.copy(), dw_want = dw.copy(), db_want = db.copy();
                     layer_norm_backward(x.data(), w.data(), mean.data(), rstd.data(), g.data(), dx.data(), dw.data(), db.data(), rows, C);
                     layer_norm_backward_reference(x.data(), w.data(), g.data(), dx_want.data(), dw_want.data(), db_want.data(), rows, C, 1e-5f);
                     if (auto ok = close(dx.data(), dx_want.data(), rows * C, 1e-3, 1e-4); !ok) return ok;
                     if (auto ok = close(dw.data(), dw_want.data(), C, 1e-4, 1e-5); !ok) return ok;
                     if (auto ok = close(db.data(), db_want.data(), C, 1e-5, 1e-6); !ok) return ok;
                     // Writing dx instead of adding: whatever it held (NaN here) is gone.
                     std::fill_n(dx.data(), rows * C, std::numeric_limits<float>::quiet_NaN());
                     std::fill(dx_want.begin(), dx_want.end(), 0.0f);
                     layer_norm_backward(x.data(), w.data(), mean.data(), rstd.data(), g.data(), dx.data(), nullptr, nullptr,
                                         rows, C, /*accumulate=*/false);
                     layer_norm_backward_reference(x.data(), w.data(), g.data(), dx_want.data(), nullptr, nullptr, rows, C, 1e-5f);
                     return close(dx.data(), dx_want.data(), rows * C, 1e-3, 1e-4);
                   }});
  for (float offset : {0.0f, 1.0f}) {  // Llama's w and Gemma's (1 + w)
    cases.push_back({offset == 0.0f ? "rms_norm forward and backward" : "rms_norm (1 + w) forward and backward",
                     [offset](int64_t n, int m) {
                       const int64_t rows = 5, C = n + 1;
                       Buffer x(rows * C, m, 1, 2.0f, 0.5f), w(C, m, 2), y(rows * C, m, 4), r(rows * C, m, 5);
                       Buffer rstd(rows, m, 7), g(rows * C, m, 8), dx(rows * C, m, 9), dw(C, m, 10);
                       rms_norm_forward(x.data(), w.data(), offset, y.data(), rstd.data(), rows, C, 1e-6f);
                       rms_norm_forward_reference(x.data(), w.data(), offset, r.data(), rows, C, 1e-6f);
                       if (auto ok = close(y.data(), r.data(), rows * C, 1e-5, 1e-6); !ok) return ok;
                       std::vector<float> dx_want = dx.copy(), dw_want = dw.copy();
                       rms_norm_backward(x.data(), w.data(), offset, rstd.data(), g.data(), dx.data(), dw.data(), rows, C);
                       rms_norm_backward_reference(x.data(), w.data(), offset, g.data(), dx_want.data(), dw_want.data(), rows, C, 1e-6f);
                       if (auto ok = close(dx.data(), dx_want.data(), rows * C, 1e-4, 1e-5); !ok) return ok;
                       if (auto ok = close(dw.data(), dw_want.data(), C, 1e-4, 1e-5); !ok) return ok;
                       std::fill_n(dx.data(), rows * C, std::numeric_limits<float>::quiet_NaN());
                       std::fill(dx_want.begin(), dx_want.end(), 0.0f);
                       rms_norm_backward(x.data(), w.data(), offset, rstd.data(), g.data(), dx.data(), nullptr, rows, C, false);
                       rms_norm_backward_reference(x.data(), w.data(), offset, g.data(), dx_want.data(), nullptr, rows, C, 1e-6f);
                       return close(dx.data(), dx_want.data(), rows * C, 1e-4, 1e-5);
                     }});
  }
  cases.push_back({"silu forward and backward", [](int64_t n, int m) {
                     Buffer x(n, m, 1, 12.0f), y(n, m, 2), r(n, m, 3), g(n, m, 4), dx(n, m, 5);
                     silu_forward(x.data(), y.data(), n);
                     silu_reference(x.data(), r.data(), n);
                     if (auto ok = close(y.data(), r.data(), n, 1e-6, 1e-6); !ok) return ok;
                     std::vector<float> want = dx.copy();
                     silu_backward(x.data(), g.data(), dx.data(), n);
                     silu_backward_reference(x.data(), g.data(), want.data(), n);
                     if (auto ok = close(dx.data(), want.data(), n, 1e-5, 1e-6); !ok) return ok;
                     std::fill_n(dx.data(), n, std::numeric_limits<float>::quiet_NaN());
                     std::fill(want.begin(), want.end(), 0.0f);
                     silu_backward(x.data(), g.data(), dx.data(), n, false);
                     silu_backward_reference(x.data(), g.data(), want.data(), n);
                     return close(dx.data(), want.data(), n, 1e-5, 1e-6);
                   }});
  // RoPE: both layouts, plain, Llama 3, YaRN and LongRoPE frequencies, a partial rotation (the first rotary_dim values
  // of each head) with an attention factor on cos and sin, a position offset (a KV cache's next chunk); the inverse
  // (the backward) undoes the forward up to the factor's square.
  for (RopeLayout layout : {RopeLayout::RotateHalf, RopeLayout::Interleaved}) {
    cases.push_back({layout == RopeLayout::RotateHalf ? "rope rotate-half" : "rope interleaved", [layout](int64_t n, int m) {
                       const int64_t heads = 3, D = 2 * (n + 1), T = 7, rows = 2 * T, stride = heads * D + 3, start = 5;
                       RopeFrequencies f;
                       f.theta = 500000.0;
                       f.original_max_position_embeddings = 64;
                       if (n % 4 == 1) {
                         f.scaling = RopeFrequencies::Scaling::Llama3;
                         f.factor = 32.0;
                       } else if (n % 4 == 2) {
                         f.scaling = RopeFrequencies::Scaling::Yarn;
                         f.factor = 8.0;
                         f.attention_factor = 1.2;
                         if (D >= 4) f.rotary_dim = D - 2;
                       } else if (n % 8 == 4) {  // Gemma 4's proportional: the whole head, its last pairs still
                         f.scaling = RopeFrequencies::Scaling::Proportional;
                         f.factor = 2.0;
                         f.rotated_pairs = std::max<int64_t>(1, D / 4);
                       } else if (n % 4 == 3) {
                         f.scaling = RopeFrequencies::Scaling::LongRope;
                         f.rotary_dim = D >= 4 ? D - 2 : 0;
                         for (int64_t i = 0; i < (f.rotary_dim > 0 ? f.rotary_dim : D) / 2; ++i) {
                           f.short_factor.push_back(1.0 + 0.25 * static_cast<double>(i));
                           f.long_factor.push_back(2.0 + static_cast<double>(i));
                         }
                         f.attention_factor = 0.9;
                       }
                       const auto inv = f.inverse_frequencies(D, n % 8 == 7);
                       const float scale = static_cast<float>(f.attention_factor);
                       const RopeTable table = RopeTable::make(inv, start + T, scale);
                       Buffer x(rows * stride, m, 1, 3.0f), y(rows * stride, m, 2);
                       std::vector<float> original = x.copy(), want = x.copy();
                       rope_apply(table, layout, x.data(), y.data(), rows, T, stride, heads, D, start, false);  // out of place
                       rope_apply_reference(inv, layout, want.data(), rows, T, stride, heads, D, start, false, scale);
                       if (auto ok = close(y.data(), want.data(), rows * stride, 1e-5, 1e-5); !ok) return ok;
                       rope_apply(table, layout, y.data(), y.data(), rows, T, stride, heads, D, start, true);  // in place
                       // rotated values come back scaled by the factor twice; the rest of a partial head unchanged
                       const int64_t R = 2 * table.P;
                       for (int64_t r = 0; r < rows; ++r)
                         for (int64_t h = 0; h < heads; ++h)
                           for (int64_t d = 0; d < R; ++d) original[static_cast<size_t>(r * stride + h * D + d)] *= scale * scale;
                       return close(y.data(), original.data(), rows * stride, 1e-5, 1e-5);
                     }});
  }
  // 16-bit conversions over patterns that include zeros, subnormals, infinities, NaNs and rounding ties.
  cases.push_back({"bf16 and f16 conversions", [](int64_t n, int m) {
                     std::vector<uint16_t> bits(static_cast<size_t>(n + m));
                     Generator gen(static_cast<uint64_t>(n * 7 + m));
                     for (auto& b : bits) b = static_cast<uint16_t>(gen.next_u64());
                     const uint16_t special[] = {0x0000, 0x8000, 0x0001, 0x7c00, 0xfc00, 0x7e00, 0x7f80, 0xff80, 0x7fc1};
                     for (size_t i = 0; i < bits.size() && i < std::size(special); ++i) bits[i] = special[i];
                     const uint16_t* src = bits.data() + m;
                     std::vector<float> got(static_cast<size_t>(n)), want(static_cast<size_t>(n));
                     auto same = [&](const char* what) {
                       for (int64_t i = 0; i < n; ++i)
                         if (std::memcmp(&got[i], &want[i], 4) != 0 && !(std::isnan(got[i]) && std::isnan(want[i])))
                           return ::testing::AssertionFailure() << what << " element " << i << ": " << got[i] << " vs " << want[i];
                       return ::testing::AssertionSuccess();
                     };
                     bf16_to_f32(src, got.data(), n);
                     for (int64_t i = 0; i < n; ++i) want[i] = bf16_to_f32_reference(src[i]);
                     if (auto ok = same("bf16"); !ok) return ok;
                     f16_to_f32(src, got.data(), n);
                     for (int64_t i = 0; i < n; ++i) want[i] = f16_to_f32_reference(src[i]);
                     if (auto ok = same("f16"); !ok) return ok;
                     Buffer f(n, m, 3, 1e3f);
                     if (n > 2) { f.data()[0] = NAN; f.data()[1] = INFINITY; f.data()[2] = 1.00390625f; }  // a tie: 1 + 2⁻⁸
                     std::vector<uint16_t> out(static_cast<size_t>(n));
                     f32_to_bf16(f.data(), out.data(), n);
                     for (int64_t i = 0; i < n; ++i)
                       if (out[i] != f32_to_bf16_reference(f.data()[i]))
                         return ::testing::AssertionFailure() << "f32→bf16 element " << i;
                     if (n > 2 && (out[2] != 0x3f80 || !std::isnan(bf16_to_f32_reference(out[0])) || out[1] != 0x7f80))
                       return ::testing::AssertionFailure() << "ties to even, NaN or Inf";
                     // f32 → f16 (F16C with ggml's NaN) against the bit-level reference, over the same bit patterns
                     // read as floats too: every class of float, half-range values and their ties
                     std::vector<float> patterns(static_cast<size_t>(n));
                     for (int64_t i = 0; i < n; ++i) {
                       const uint32_t b = static_cast<uint32_t>(src[i]) * 0x10001u ^ (i % 3 ? 0x38000000u : 0u);
                       std::memcpy(&patterns[i], &b, 4);
                     }
                     for (const float* from : {static_cast<const float*>(f.data()), static_cast<const float*>(patterns.data())}) {
                       f32_to_f16(from, out.data(), n);
                       for (int64_t i = 0; i < n; ++i)
                         if (out[i] != f32_to_f16_reference(from[i]))
                           return ::testing::AssertionFailure() << "f32→f16 element " << i << ": " << out[i] << " vs "
                                                                << f32_to_f16_reference(from[i]);
                     }
                     f32_to_f16(f.data(), out.data(), n);
                     if (n > 2 && (out[0] != 0x7e00 || out[1] != 0x7c00))
                       return ::testing::AssertionFailure() << "f16 NaN or Inf";
                     return ::testing::AssertionSuccess();
                   }});
  cases.push_back({"embedding backward", [](int64_t n, int m) {
                     const int64_t V = 7, C = n + 1;
                     std::vector<int64_t> ids(13);
                     for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int64_t>(i * 5 % V);
                     Buffer g(13 * C, m, 1), dw(V * C, m, 2), y(13 * C, m, 3), w(V * C, m, 4);
                     std::vector<float> want = dw.copy();
                     embedding_backward(ids.data(), 13, C, g.data(), dw.data());
                     embedding_backward_reference(ids.data(), 13, C, g.data(), want.data());
                     if (auto ok = close(dw.data(), want.data(), V * C, 0, 0); !ok) return ok;
                     embedding_forward(w.data(), ids.data(), 13, C, y.data());
                     for (int64_t i = 0; i < 13; ++i)
                       if (auto ok = close(y.data() + i * C, w.data() + ids[static_cast<size_t>(i)] * C, C, 0, 0); !ok) return ok;
                     return ::testing::AssertionSuccess();
                   }});
  cases.push_back({"adamw_update and sum_of_squares", [](int64_t n, int m) {
                     Buffer w(n, m, 1), g(n, m, 2), mo(n, m, 3, 0.1f), v(n, m, 4, 0.1f, 0.2f);
                     std::vector<float> w2 = w.copy(), m2 = mo.copy(), v2 = v.copy();
                     const AdamWStep s{0.999f, 0.9f, 0.999f, 0.1f, 0.001f, 1e-3f, 0.05f, 1e-8f};
                     adamw_update(w.data(), g.data(), mo.data(), v.data(), n, s);
                     adamw_update_reference(w2.data(), g.data(), m2.data(), v2.data(), n, s);
                     // Within an ulp: the compiler may fuse w·decay − step·(m/denom) into an FMA in one and not the other.
                     if (auto ok = close(w.data(), w2.data(), n, 2.5e-7, 0); !ok) return ok;
                     if (auto ok = close(v.data(), v2.data(), n, 0, 0); !ok) return ok;
                     const double a = sum_of_squares(g.data(), n), b = sum_of_squares_reference(g.data(), n);
                     return std::fabs(a - b) <= 1e-12 * (1 + b) ? ::testing::AssertionSuccess()
                                                                : ::testing::AssertionFailure() << a << " vs " << b;
                   }});
  cases.push_back({"gemm", [](int64_t n, int m) {
                     for (bool ta : {false, true})
                       for (bool tb : {false, true}) {
                         const int64_t M = n, N = 7, K = n + 2;
                         Buffer A(M * K, m, 1), B(K * N, m, 2), C(M * N, m, 3);
                         std::vector<float> R = C.copy();
                         gemm(ta, tb, M, N, K, 0.5f, A.data(), ta ? M : K, B.data(), tb ? K : N, 1.5f, C.data(), N);
                         gemm_reference(ta, tb, M, N, K, 0.5f, A.data(), ta ? M : K, B.data(), tb ? K : N, 1.5f, R.data(), N);
                         if (auto ok = close(C.data(), R.data(), M * N, 1e-5, 1e-5); !ok) return ok;
                       }
                     return ::testing::AssertionSuccess();
                   }});
  // Products with stored weights, every type: W (N × K) quantized from random values and placed 0, 2 or 6 bytes past a
  // 64-byte boundary (any GGUF row is 2-byte aligned; MXFP4's, of 17-byte blocks, 0, 1 or 3 bytes: any), X and Y strided and misaligned as the other rows; M = 1, 3, 9 and
  // 70 (groups of 4 and a tail; integer dots for the block types, against X quantized as they do), at 70 rows the panels'
  // alternative (widened W and sgemm against float32 X) too; then the backward. Block types' K are 1–6 blocks (Q8_0, Q4_0: groups of 2 and 4 and their
  // tails), the float types' any length. Tolerance: 1e-5 of Σ|w·x| (float32 sums of products that may cancel).
  for (WeightType type : {WeightType::F32, WeightType::F16, WeightType::BF16, WeightType::Q8_0, WeightType::Q4_0,
                          WeightType::Q4_K, WeightType::Q5_K, WeightType::Q6_K, WeightType::MXFP4}) {
    static std::deque<std::string> names;  // the cases keep pointers to their names
    names.push_back(std::string("gemm_weight ") + weight_type_name(type) + " forward and backward");
    cases.push_back({names.back().c_str(), [type](int64_t n, int m) {
                       const int64_t block = weight_type_info(type).block_elements;
                       const bool k_quant = block == 256;
                       const int64_t K = block == 1 ? n + 1 : block * (1 + n % (k_quant ? 3 : 6));
                       const int64_t N = 1 + (n * 7) % (k_quant ? 9 : 23), row = row_bytes(type, K);
                       Buffer values(N * K, 0, 21);
                       std::vector<unsigned char> storage(static_cast<size_t>(N * row + 128));
                       unsigned char* at = storage.data() + (64 - reinterpret_cast<uintptr_t>(storage.data()) % 64) % 64 +
                                           (type == WeightType::F32 ? 4 : type == WeightType::MXFP4 ? 1 : 2) * m;
                       quantize_rows(type, values.data(), at, N, K);
                       const WeightView w{type, at, N, K};
                       std::vector<float> dense(static_cast<size_t>(N * K));
                       dequantize_rows(type, at, dense.data(), N, K);
                       // |got − want| ≤ 1e-5·(Σ|a·b| + |beta·prior|) per element
                       auto within = [](const float* got, const float* want, const std::vector<double>& size, int64_t rows,
                                        int64_t cols, int64_t ld) -> ::testing::AssertionResult {
                         for (int64_t i = 0; i < rows; ++i)
                           for (int64_t j = 0; j < cols; ++j) {
                             const double g = got[i * ld + j], e = want[i * ld + j], bound = 1e-5 * size[i * cols + j] + 1e-30;
                             if (!(std::fabs(g - e) <= bound))
                               return ::testing::AssertionFailure() << "[" << i << "," << j << "] " << g << " vs " << e;
                           }
                         return ::testing::AssertionSuccess();
                       };
                       for (int64_t M : {int64_t{1}, int64_t{3}, int64_t{9}, int64_t{70}}) {
                         const int64_t ldx = K + 3, ldy = N + 2;
                         Buffer x(M * ldx, m, 22, 2.0f), y(M * ldy, m, 23);
                         std::vector<float> want = y.copy();
                         std::vector<double> size(static_cast<size_t>(M * N));
                         for (int64_t i = 0; i < M; ++i)
                           for (int64_t j = 0; j < N; ++j) {
                             double s = std::fabs(0.5 * y.data()[i * ldy + j]);
                             for (int64_t k = 0; k < K; ++k) s += std::fabs(double{dense[j * K + k]} * x.data()[i * ldx + k]);
                             size[i * N + j] = s;
                           }
                         gemm_weight(w, M, x.data(), ldx, 0.5f, y.data(), ldy);
                         gemm_weight_integer_reference(w, M, x.data(), ldx, 0.5f, want.data(), ldy);
                         if (auto ok = within(y.data(), want.data(), size, M, N, ldy); !ok) return ok << " (forward, M " << M << ")";
                         if (M == 70 && type != WeightType::F32) {  // the panels' alternative at 70 rows
                           std::vector<float> panels = want;
                           gemm_weight_panels(w, M, x.data(), ldx, 0.0f, panels.data(), ldy);
                           gemm_weight_reference(w, M, x.data(), ldx, 0.0f, want.data(), ldy);
                           if (auto ok = within(panels.data(), want.data(), size, M, N, ldy); !ok) return ok << " (panels, M 70)";
                         }
                         // the backward: dX (M × K) = dY · W + 0.5·dX
                         Buffer dx(M * ldx, m, 24);
                         std::vector<float> dx_want = dx.copy();
                         std::vector<double> dx_size(static_cast<size_t>(M * K));
                         for (int64_t i = 0; i < M; ++i)
                           for (int64_t k = 0; k < K; ++k) {
                             double s = std::fabs(0.5 * dx.data()[i * ldx + k]);
                             for (int64_t j = 0; j < N; ++j) s += std::fabs(double{dense[j * K + k]} * y.data()[i * ldy + j]);
                             dx_size[i * K + k] = s;
                           }
                         gemm_weight_backward(w, M, y.data(), ldy, 0.5f, dx.data(), ldx);
                         gemm_weight_backward_reference(w, M, y.data(), ldy, 0.5f, dx_want.data(), ldx);
                         if (auto ok = within(dx.data(), dx_want.data(), dx_size, M, K, ldx); !ok) return ok << " (backward, M " << M << ")";
                       }
                       return ::testing::AssertionSuccess();
                     }});
  }
  // Row-independent products (sessions): against gemm_reference in double, and each row alone gives the same bits.
  cases.push_back({"gemm_rows_nt", [](int64_t n, int m) {
                     const int64_t M = n % 9 + 1, N = n + 3, K = 2 * n + 1;
                     Buffer A(M * K, m, 1), B(N * K, m, 2), C(M * N, m, 3);
                     std::vector<float> R = C.copy(), alone = C.copy();
                     gemm_rows_nt(M, N, K, 0.5f, A.data(), K, B.data(), K, 1.5f, C.data(), N);
                     gemm_reference(false, true, M, N, K, 0.5f, A.data(), K, B.data(), K, 1.5f, R.data(), N);
                     if (auto ok = close(C.data(), R.data(), M * N, 1e-5, 1e-5); !ok) return ok;
                     for (int64_t r = 0; r < M; ++r)
                       gemm_rows_nt(1, N, K, 0.5f, A.data() + r * K, K, B.data(), K, 1.5f, alone.data() + r * N, N);
                     return std::memcmp(alone.data(), C.data(), static_cast<size_t>(M * N) * sizeof(float)) == 0
                                ? ::testing::AssertionSuccess()
                                : ::testing::AssertionFailure() << "a row alone differs from the same row in the batch";
                   }});
  // RoPE with a position per row (a session's batch) against the double reference, row by row.
  cases.push_back({"rope at a position per row", [](int64_t n, int m) {
                     const int64_t heads = 2, D = 2 * (n % 6 + 1), rows = n + 1, stride = heads * D + 1;
                     const auto inv = RopeFrequencies{}.inverse_frequencies(D);
                     const RopeTable table = RopeTable::make(inv, 64);
                     std::vector<int64_t> positions;
                     for (int64_t r = 0; r < rows; ++r) positions.push_back((r * 37 + n) % 64);
                     Buffer x(rows * stride, m, 4);
                     std::vector<float> want = x.copy();
                     rope_apply_rows(table, RopeLayout::RotateHalf, x.data(), x.data(), rows, positions.data(), stride, heads, D);
                     for (int64_t r = 0; r < rows; ++r)
                       rope_apply_reference(inv, RopeLayout::RotateHalf, want.data() + r * stride, 1, 1, stride, heads, D,
                                            positions[static_cast<size_t>(r)], false);
                     return close(x.data(), want.data(), rows * stride, 1e-5, 1e-5);
                   }});
  // Every variant of the fused kernel beside its reference at every n: MHA and grouped-query (4 query heads on 2 or
  // 1 K/V heads), causal or not, a sliding window of 3 and soft-capping.
  struct Variant {
    const char* name;
    int64_t H_kv, window;
    float softcap;
    int causal;  // 0 no, 1 yes, 2 when n is even
    bool bf16 = false;  // bf16 products, against the reference on rounded operands (to bf16's precision)
    bool sinks = false;  // a learned sink logit per head (gpt-oss), and its gradient
  };
  for (const Variant variant : {Variant{"attention forward and backward", 4, 0, 0.0f, 2},
                                Variant{"attention, grouped-query (4 heads, 2 K/V)", 2, 0, 0.0f, 2},
                                Variant{"attention, multi-query, sliding window 3", 1, 3, 0.0f, 1},
                                Variant{"attention, grouped-query, soft-capped, window 5", 2, 5, 1.5f, 1},
                                Variant{"attention, bf16 products, grouped-query", 2, 0, 0.0f, 2, true},
                                Variant{"attention, bf16 products, multi-query, window 5", 1, 5, 0.0f, 1, true},
                                Variant{"attention sinks, grouped-query", 2, 0, 0.0f, 2, false, true},
                                Variant{"attention sinks, bf16 products", 2, 0, 0.0f, 1, true, true}}) {
    cases.push_back({variant.name, [variant](int64_t n, int m) {
                       if (n == 0) return ::testing::AssertionSuccess();  // T = 0 has its own tests
                       // Not n = 1023: the double-precision reference's T² work there took seconds per variant (a
                       // minute under ASan) and adds no new shape of blocks — 257 already spans several 48-row query
                       // blocks and 64- or 128-key blocks with a ragged last one.
                       if (n > 257) return ::testing::AssertionSuccess();
                       const AttentionDims d{1, 4, n, n, 5, variant.H_kv};
                       AttentionLayout l;
                       l.q = l.o = AttentionStrides::bhtd(d, n);
                       l.k = l.v = AttentionStrides::bhtd(variant.H_kv, 5, n);
                       AttentionOptions o;
                       o.causal = variant.causal == 1 || (variant.causal == 2 && n % 2 == 0);
                       o.window = variant.window;
                       o.softcap = variant.softcap;
                       o.bf16 = variant.bf16 && attention_bf16_available();
                       Buffer sinks(4, m, 14, 3.0f);  // logits in ±3: from a small to a dominant share of each row
                       if (variant.sinks) o.sinks = sinks.data();
                       // float32: 1e-5; bf16 products: the rounding of the P and dS tiles (2⁻⁹) on sums of N(0, 1)
                       const double rtol = o.bf16 ? 4e-3 : 1e-5, atol = o.bf16 ? 1e-2 : 1e-6, grad_rtol = o.bf16 ? 4e-3 : 1e-4,
                                    grad_atol = o.bf16 ? 1e-2 : 1e-5;
                       const int64_t size = 4 * n * 5, kv_size = variant.H_kv * n * 5;
                       Buffer q(size, m, 1), k(kv_size, m, 2), v(kv_size, m, 3), out(size, m, 4), ref(size, m, 5), lse(4 * n, m, 6);
                       attention_forward(d, l, o, q.data(), k.data(), v.data(), out.data(), lse.data());
                       attention_forward_reference(d, l, o, q.data(), k.data(), v.data(), ref.data());
                       if (auto ok = close(out.data(), ref.data(), size, rtol, atol); !ok) return ok;
                       Buffer g(size, m, 7), dq(size, m, 8), dk(kv_size, m, 9), dv(kv_size, m, 10), rq(size, m, 11),
                           rk(kv_size, m, 12), rv(kv_size, m, 13);
                       attention_backward(d, l, o, q.data(), k.data(), v.data(), out.data(), lse.data(), g.data(), dq.data(), dk.data(), dv.data());
                       attention_backward_reference(d, l, o, q.data(), k.data(), v.data(), g.data(), rq.data(), rk.data(), rv.data());
                       if (auto ok = close(dq.data(), rq.data(), size, grad_rtol, grad_atol); !ok) return ok;
                       for (auto [a, b] : {std::pair{dk.data(), rk.data()}, {dv.data(), rv.data()}})
                         if (auto ok = close(a, b, kv_size, grad_rtol, grad_atol); !ok) return ok;
                       if (variant.sinks) {
                         Buffer d_sinks(4, m, 15), r_sinks(4, m, 16);
                         attention_sink_backward(d, l, o.sinks, out.data(), lse.data(), g.data(), d_sinks.data());
                         attention_sink_backward_reference(d, l, o, q.data(), k.data(), v.data(), g.data(), r_sinks.data());
                         if (auto ok = close(d_sinks.data(), r_sinks.data(), 4, grad_rtol, grad_atol * n); !ok) return ok << " (d sinks)";
                       }
                       return ::testing::AssertionSuccess();
                     }});
  }
  cases.push_back({"attention_gate forward and backward (gate read in place from a doubled q projection)",
                   [](int64_t n, int m) {
                     const int64_t rows = 3, H = 2, D = n;  // gate rows of 2·H·D: each head's q then its gate
                     Buffer o(rows * H * D, m, 1, 2.0f), qg(rows * 2 * H * D, m, 2, 4.0f), g(rows * H * D, m, 3);
                     Buffer out(rows * H * D, m, 4), ref(rows * H * D, m, 5);
                     attention_gate_forward(rows, H, D, o.data(), qg.data() + D, 2 * H * D, 2 * D, out.data());
                     attention_gate_forward_reference(rows, H, D, o.data(), qg.data() + D, 2 * H * D, 2 * D, ref.data());
                     if (auto ok = close(out.data(), ref.data(), rows * H * D, 1e-6, 1e-7); !ok) return ok;
                     Buffer d_o(rows * H * D, m, 6), r_o(rows * H * D, m, 7);
                     std::vector<float> d_qg(static_cast<size_t>(rows * 2 * H * D), 7.0f), r_qg = d_qg;
                     attention_gate_backward(rows, H, D, o.data(), qg.data() + D, 2 * H * D, 2 * D, g.data(), d_o.data(),
                                             d_qg.data() + D);
                     attention_gate_backward_reference(rows, H, D, o.data(), qg.data() + D, 2 * H * D, 2 * D, g.data(),
                                                       r_o.data(), r_qg.data() + D);
                     if (auto ok = close(d_o.data(), r_o.data(), rows * H * D, 1e-6, 1e-7); !ok) return ok;
                     // the query halves are left as they were (7)
                     return close(d_qg.data(), r_qg.data(), rows * 2 * H * D, 1e-5, 1e-7);
                   }});
  cases.push_back({"gated delta rule forward and backward (recurrent form, state rebuilt every 64 tokens)",
                   [](int64_t n, int m) {
                     // n tokens (past 64: more than one stretch), 2 sequences, 2 heads, Dk 3, Dv 5
                     const DeltaRuleDims d{2, n, 2, 3, 5};
                     const int64_t rows = d.B * d.T * d.H;
                     Buffer q(rows * d.Dk, m, 1), k(rows * d.Dk, m, 2, 0.5f), v(rows * d.Dv, m, 3), g_out(rows * d.Dv, m, 4);
                     Buffer g(rows, m, 5, 0.3f, -0.4f), beta(rows, m, 6, 0.3f, 0.5f), init(d.B * d.H * d.Dk * d.Dv, m, 7);
                     Buffer o(rows * d.Dv, m, 8), ref(rows * d.Dv, m, 9), final_state(d.B * d.H * d.Dk * d.Dv, m, 10);
                     delta_rule_forward(d, q.data(), k.data(), v.data(), g.data(), beta.data(), init.data(), o.data(), final_state.data());
                     delta_rule_forward_reference(d, q.data(), k.data(), v.data(), g.data(), beta.data(), init.data(), ref.data());
                     if (auto ok = close(o.data(), ref.data(), rows * d.Dv, 1e-4, 1e-5); !ok) return ok << " (o)";
                     return delta_gradients_match(delta_rule_backward, d, q.data(), k.data(), v.data(), g.data(), beta.data(),
                                                  init.data(), g_out.data(), m);
                   }});
  cases.push_back({"gated delta rule forward and backward, chunked form (64 tokens a chunk, from a state)",
                   [](int64_t n, int m) {
                     // 2n + 5 tokens up to 195 (a part of a chunk, one and a part, up to four), 2 sequences, 3 heads,
                     // Dk 16, Dv 24 (the double reference's longer runs took 13 s under ASan and add nothing)
                     const DeltaRuleDims d{2, 5 + std::min<int64_t>(2 * n, 190), 3, 16, 24};
                     const int64_t rows = d.B * d.T * d.H, states = d.B * d.H * d.Dk * d.Dv;
                     Buffer q(rows * d.Dk, m, 1, 0.25f), k(rows * d.Dk, m, 2, 0.25f), v(rows * d.Dv, m, 3);
                     Buffer g(rows, m, 5, 0.3f, -0.4f), beta(rows, m, 6, 0.3f, 0.5f), init(states, m, 7);
                     Buffer o(rows * d.Dv, m, 8), ref(rows * d.Dv, m, 9), final_state(states, m, 10);
                     Buffer o_rec(rows * d.Dv, m, 11), final_rec(states, m, 12);
                     delta_rule_forward_chunked(d, q.data(), k.data(), v.data(), g.data(), beta.data(), init.data(), o.data(),
                                                final_state.data());
                     delta_rule_forward_reference(d, q.data(), k.data(), v.data(), g.data(), beta.data(), init.data(), ref.data());
                     if (auto ok = close(o.data(), ref.data(), rows * d.Dv, 1e-4, 1e-5); !ok) return ok << " (o)";
                     delta_rule_forward(d, q.data(), k.data(), v.data(), g.data(), beta.data(), init.data(), o_rec.data(),
                                        final_rec.data());
                     if (auto ok = close(final_state.data(), final_rec.data(), states, 1e-4, 1e-5); !ok)
                       return ok << " (the final state)";
                     Buffer g_out(rows * d.Dv, m, 4);
                     return delta_gradients_match(delta_rule_backward_chunked, d, q.data(), k.data(), v.data(), g.data(),
                                                  beta.data(), init.data(), g_out.data(), m);
                   }});
  cases.push_back({"causal depthwise conv1d forward and backward (K 4, with and without a state before)",
                   [](int64_t n, int m) {
                     // n tokens of 2 sequences, C = 5 channels (a vector row and a tail on AVX-512 as n grows)
                     for (const bool with_state : {false, true}) {
                       const CausalConvDims d{2, n, 5 + n % 19, 4};
                       const int64_t size = d.B * d.T * d.C;
                       Buffer x(size, m, 1), w(d.C * d.K, m, 2), state(d.B * (d.K - 1) * d.C, m, 3), dy(size, m, 4);
                       Buffer y(size, m, 5), ry(size, m, 6), dx(size, m, 7), rdx(size, m, 8), dw(d.C * d.K, m, 9),
                           rdw(d.C * d.K, m, 10);
                       const float* before = with_state ? state.data() : nullptr;
                       causal_conv1d_forward(d, x.data(), w.data(), before, y.data());
                       causal_conv1d_forward_reference(d, x.data(), w.data(), before, ry.data());
                       if (auto ok = close(y.data(), ry.data(), size, 1e-5, 1e-6); !ok) return ok << " (y)";
                       causal_conv1d_backward(d, x.data(), w.data(), before, dy.data(), dx.data(), dw.data());
                       causal_conv1d_backward_reference(d, x.data(), w.data(), before, dy.data(), rdx.data(), rdw.data());
                       if (auto ok = close(dx.data(), rdx.data(), size, 1e-5, 1e-6); !ok) return ok << " (dx)";
                       if (auto ok = close(dw.data(), rdw.data(), d.C * d.K, 1e-4, 1e-5); !ok) return ok << " (dw)";
                     }
                     return ::testing::AssertionSuccess();
                   }});
  for (int mode : {0, 1, 2}) {
    const bool norm = mode != 1;
    cases.push_back({mode == 0   ? "moe forward and backward (4 experts, top-2, renormalised)"
                     : mode == 1 ? "moe, top-2 not renormalised"
                                 : "moe, DeepSeek-V3 router (sigmoid, bias, 2 of 3 groups, top-3, scaled)",
                     [norm, mode](int64_t n, int m) {
                       // n tokens of C = 5 on E = 4 SwiGLU experts of F = 3 (n = 0: nothing routed, zero gradients);
                       // DeepSeek-V3's router: 6 experts in 3 groups of 2, the best 2 groups kept, 3 experts chosen
                       const MoeDims d = mode == 2 ? MoeDims{n, 5, 3, 6, 3} : MoeDims{n, 5, 3, 4, 2};
                       MoeOptions options;
                       options.norm_topk_prob = norm;
                       Buffer bias(d.E, m, 9, 0.5f);
                       if (mode == 2) {
                         options.sigmoid = true;
                         options.selection_bias = bias.data();
                         options.groups = 3;
                         options.groups_kept = 2;
                         options.scaling = 2.5f;
                       }
                       Buffer x(n * d.C, m, 1), router(d.E * d.C, m, 2, 2.0f), g_out(n * d.C, m, 3);
                       std::vector<Buffer> weights;
                       for (int64_t i = 0; i < 3 * d.E; ++i) weights.emplace_back(d.F * d.C, m, 10 + i);
                       std::vector<const float*> gate, up, down;
                       for (int64_t e = 0; e < d.E; ++e) {
                         gate.push_back(weights[static_cast<size_t>(e)].data());
                         up.push_back(weights[static_cast<size_t>(d.E + e)].data());
                         down.push_back(weights[static_cast<size_t>(2 * d.E + e)].data());
                       }
                       Buffer out(n * d.C, m, 4), ref(n * d.C, m, 5);
                       MoeSaved saved;
                       moe_forward(d, options, x.data(), router.data(), gate.data(), up.data(), down.data(), out.data(), saved);
                       moe_forward_reference(d, options, x.data(), router.data(), gate.data(), up.data(), down.data(), ref.data());
                       if (auto ok = close(out.data(), ref.data(), n * d.C, 1e-5, 1e-6); !ok) return ok << " (out)";
                       // gradients: fast (NaN-filled first: every element must be written) against the reference
                       const float nan = std::numeric_limits<float>::quiet_NaN();
                       auto grads = [&](float fill) {
                         std::vector<std::vector<float>> g(3 * d.E + 2);
                         g[0].assign(static_cast<size_t>(n * d.C), fill);
                         g[1].assign(static_cast<size_t>(d.E * d.C), fill);
                         for (int64_t i = 0; i < 3 * d.E; ++i) g[static_cast<size_t>(2 + i)].assign(static_cast<size_t>(d.F * d.C), fill);
                         return g;
                       };
                       auto fast = grads(nan), want = grads(0.0f);
                       auto pointers = [&](std::vector<std::vector<float>>& g, int64_t first) {
                         std::vector<float*> p;
                         for (int64_t e = 0; e < d.E; ++e) p.push_back(g[static_cast<size_t>(2 + first + e)].data());
                         return p;
                       };
                       auto fg = pointers(fast, 0), fu = pointers(fast, d.E), fd = pointers(fast, 2 * d.E);
                       auto wg = pointers(want, 0), wu = pointers(want, d.E), wd = pointers(want, 2 * d.E);
                       moe_backward(d, options, x.data(), router.data(), gate.data(), up.data(), down.data(), saved,
                                    g_out.data(), fast[0].data(), fast[1].data(), fg.data(), fu.data(), fd.data());
                       moe_backward_reference(d, options, x.data(), router.data(), gate.data(), up.data(), down.data(),
                                              g_out.data(), want[0].data(), want[1].data(), wg.data(), wu.data(), wd.data());
                       for (size_t i = 0; i < fast.size(); ++i)
                         if (auto ok = close(fast[i].data(), want[i].data(), static_cast<int64_t>(fast[i].size()), 1e-4, 1e-5); !ok)
                           return ok << " (gradient " << i << ")";
                       return ::testing::AssertionSuccess();
                     }});
  }
  // gpt-oss: top-2 of 4 by the logits + a bias, the softmax of those two; stacked experts with biases, gate/up columns
  // interleaved; the clamped SwiGLU with a limit low enough that both clamps cut.
  // gpt-oss's layer as both cases below run it: top-2 of 4, a router bias, stacked experts with biases, a clamp
  struct GptOssLayer {
    MoeDims d;
    MoeOptions options;
    Buffer x, router, bias, g_out, gate_up, gate_up_bias, down, down_bias;
    GptOssLayer(int64_t n, int m)
        : d{n, 5, 3, 4, 2}, x(n * d.C, m, 1), router(d.E * d.C, m, 2, 2.0f), bias(d.E, m, 3), g_out(n * d.C, m, 4),
          gate_up(d.E * d.C * 2 * d.F, m, 5), gate_up_bias(d.E * 2 * d.F, m, 6), down(d.E * d.F * d.C, m, 7),
          down_bias(d.E * d.C, m, 8) {
      options.top_k_then_softmax = true;
      options.swiglu_limit = 0.6f;
    }
    // The forward of `w` into out (its state into saved), against the reference
    ::testing::AssertionResult forward(const MoeStacked& w, Buffer& out, MoeSaved& saved) {
      Buffer ref(d.N * d.C, 1, 10);
      moe_forward(d, options, x.data(), router.data(), bias.data(), w, out.data(), saved);
      moe_forward_reference(d, options, x.data(), router.data(), bias.data(), w, ref.data());
      if (auto ok = close(out.data(), ref.data(), d.N * d.C, 1e-5, 1e-6); !ok) return ok << " (out)";
      return ::testing::AssertionSuccess();
    }
  };
  cases.push_back({"moe, gpt-oss (router bias, top-k then softmax, stacked experts with biases, clamped SwiGLU)",
                   [](int64_t n, int m) {
                     GptOssLayer layer(n, m);
                     const MoeDims& d = layer.d;
                     const MoeOptions& options = layer.options;
                     Buffer &x = layer.x, &router = layer.router, &bias = layer.bias, &g_out = layer.g_out;
                     const MoeStacked w{layer.gate_up.data(), layer.gate_up_bias.data(), layer.down.data(), layer.down_bias.data()};
                     Buffer out(n * d.C, m, 9);
                     MoeSaved saved;
                     if (auto ok = layer.forward(w, out, saved); !ok) return ok;
                     const float nan = std::numeric_limits<float>::quiet_NaN();
                     const std::vector<int64_t> sizes = {n * d.C, d.E * d.C, d.E, d.E * d.C * 2 * d.F, d.E * 2 * d.F,
                                                         d.E * d.F * d.C, d.E * d.C};
                     std::vector<std::vector<float>> fast, want;
                     for (int64_t size : sizes) {
                       fast.emplace_back(static_cast<size_t>(size), nan);  // every element must be written
                       want.emplace_back(static_cast<size_t>(size), 0.0f);
                     }
                     auto grads = [](std::vector<std::vector<float>>& g) {
                       return MoeStackedGrads{g[3].data(), g[4].data(), g[5].data(), g[6].data()};
                     };
                     moe_backward(d, options, x.data(), router.data(), bias.data(), w, saved, g_out.data(),
                                  fast[0].data(), fast[1].data(), fast[2].data(), grads(fast));
                     moe_backward_reference(d, options, x.data(), router.data(), bias.data(), w, g_out.data(),
                                            want[0].data(), want[1].data(), want[2].data(), grads(want));
                     const char* names[] = {"dx", "d_router", "d_router_bias", "d_gate_up", "d_gate_up_bias", "d_down",
                                            "d_down_bias"};
                     for (size_t i = 0; i < fast.size(); ++i)
                       if (auto ok = close(fast[i].data(), want[i].data(), static_cast<int64_t>(fast[i].size()), 1e-4, 1e-5); !ok)
                         return ok << " (" << names[i] << ")";
                     return ::testing::AssertionSuccess();
                   }});
  // LoRA on experts kept one tensor per expert (Qwen3-MoE's): a pair per expert and projection (rank 2; expert 1's up
  // has none), against the reference (which adds each update to its weight); then the same experts as stored rows
  // (float32 views), whose backward (through the rows) must agree.
  cases.push_back({"moe, LoRA on each expert's gate, up and down (float32 and stored)", [](int64_t n, int m) {
                     const MoeDims d{n, 5, 3, 4, 2};
                     const int64_t r = 2;
                     MoeOptions options;
                     Buffer x(n * d.C, m, 1), router(d.E * d.C, m, 2, 2.0f), g_out(n * d.C, m, 3);
                     std::vector<Buffer> weights, adapters;
                     for (int64_t i = 0; i < 3 * d.E; ++i) weights.emplace_back(d.F * d.C, m, 10 + i);
                     // per projection p (gate, up, down) and expert e: A (r, in) then B (out, r), in = C or F
                     for (int64_t i = 0; i < 3 * d.E; ++i) {
                       adapters.emplace_back(r * d.C, m, 40 + 2 * i);
                       adapters.emplace_back(d.C * r, m, 41 + 2 * i);
                     }
                     std::vector<const float*> gate, up, down, la[3], lb[3];
                     for (int64_t e = 0; e < d.E; ++e) {
                       gate.push_back(weights[static_cast<size_t>(e)].data());
                       up.push_back(weights[static_cast<size_t>(d.E + e)].data());
                       down.push_back(weights[static_cast<size_t>(2 * d.E + e)].data());
                       for (int p = 0; p < 3; ++p) {
                         const bool none = p == 1 && e == 1;
                         la[p].push_back(none ? nullptr : adapters[static_cast<size_t>(2 * (p * d.E + e))].data());
                         lb[p].push_back(none ? nullptr : adapters[static_cast<size_t>(2 * (p * d.E + e) + 1)].data());
                       }
                     }
                     const MoeExpertLora lora{{la[0].data(), lb[0].data(), r, 0.5f}, {la[1].data(), lb[1].data(), r, 1.5f},
                                              {la[2].data(), lb[2].data(), r, 0.75f}};
                     Buffer out(n * d.C, m, 4), ref(n * d.C, m, 5);
                     MoeSaved saved;
                     moe_forward(d, options, x.data(), router.data(), gate.data(), up.data(), down.data(), lora, out.data(), saved);
                     moe_forward_reference(d, options, x.data(), router.data(), gate.data(), up.data(), down.data(), ref.data(), &lora);
                     if (auto ok = close(out.data(), ref.data(), n * d.C, 1e-5, 1e-6); !ok) return ok << " (out)";
                     const float nan = std::numeric_limits<float>::quiet_NaN();
                     // dx, d_router, then each projection's dA and dB per expert (2·r·C values each at most)
                     auto grads = [&](float fill) {
                       std::vector<std::vector<float>> g(2 + 6 * d.E);
                       g[0].assign(static_cast<size_t>(n * d.C), fill);
                       g[1].assign(static_cast<size_t>(d.E * d.C), fill);
                       for (size_t i = 2; i < g.size(); ++i) g[i].assign(static_cast<size_t>(r * d.C), fill);
                       return g;
                     };
                     auto fast = grads(nan), want = grads(0.0f), stored = grads(nan);
                     auto lora_grads = [&](std::vector<std::vector<float>>& g, std::vector<float*> (&p)[6]) {
                       for (int k = 0; k < 6; ++k) {
                         p[k].clear();
                         for (int64_t e = 0; e < d.E; ++e)
                           p[k].push_back(la[k / 2][static_cast<size_t>(e)] ? g[static_cast<size_t>(2 + k * d.E + e)].data() : nullptr);
                       }
                       return MoeExpertLoraGrads{p[0].data(), p[1].data(), p[2].data(), p[3].data(), p[4].data(), p[5].data()};
                     };
                     std::vector<float*> fp[6], wp[6], sp[6];
                     moe_backward(d, options, x.data(), router.data(), gate.data(), up.data(), down.data(), lora, saved,
                                  g_out.data(), fast[0].data(), fast[1].data(), nullptr, nullptr, nullptr, lora_grads(fast, fp));
                     moe_backward_reference(d, options, x.data(), router.data(), gate.data(), up.data(), down.data(),
                                            g_out.data(), want[0].data(), want[1].data(), nullptr, nullptr, nullptr, &lora,
                                            lora_grads(want, wp));
                     auto sizes = [&](size_t i) -> int64_t {  // dA (r × in) or dB (out × r); in, out: C or F
                       if (i < 2) return static_cast<int64_t>(fast[i].size());
                       const int64_t k = static_cast<int64_t>(i - 2) / d.E;  // gate A, gate B, up A, up B, down A, down B
                       const int64_t in = k < 4 ? d.C : d.F, out = k < 4 ? d.F : d.C;
                       if (la[k / 2][static_cast<size_t>((static_cast<int64_t>(i) - 2) % d.E)] == nullptr) return 0;
                       return k % 2 == 0 ? r * in : out * r;
                     };
                     for (size_t i = 0; i < fast.size(); ++i)
                       if (auto ok = close(fast[i].data(), want[i].data(), sizes(i), 1e-4, 1e-5); !ok) return ok << " (gradient " << i << ")";
                     std::vector<WeightView> vg, vu, vd;
                     for (int64_t e = 0; e < d.E; ++e) {
                       vg.push_back({WeightType::F32, gate[static_cast<size_t>(e)], d.F, d.C});
                       vu.push_back({WeightType::F32, up[static_cast<size_t>(e)], d.F, d.C});
                       vd.push_back({WeightType::F32, down[static_cast<size_t>(e)], d.C, d.F});
                     }
                     Buffer out2(n * d.C, m, 6);
                     MoeSaved saved2;
                     moe_forward(d, options, x.data(), router.data(), vg.data(), vu.data(), vd.data(), lora, out2.data(), saved2);
                     if (auto ok = close(out2.data(), out.data(), n * d.C, 1e-5, 1e-6); !ok) return ok << " (stored: out)";
                     moe_backward(d, options, x.data(), router.data(), vg.data(), vu.data(), vd.data(), lora, saved2,
                                  g_out.data(), stored[0].data(), stored[1].data(), lora_grads(stored, sp));
                     for (size_t i = 0; i < stored.size(); ++i)
                       if (auto ok = close(stored[i].data(), fast[i].data(), sizes(i), 1e-4, 1e-5); !ok)
                         return ok << " (stored: gradient " << i << ")";
                     return ::testing::AssertionSuccess();
                   }});
  // LoRA on gpt-oss's stacked experts (PEFT's target_parameters layout): rank 2 per expert on gate_up and down, A's
  // rows grouped by expert and B's columns interleaved by it, against the reference (which adds each expert's update
  // to its weight); then the same experts as stored rows (float32 views, transposed), whose side path must agree.
  cases.push_back({"moe, gpt-oss with LoRA on the stacked experts (float32 and stored)", [](int64_t n, int m) {
                     GptOssLayer layer(n, m);
                     const MoeDims& d = layer.d;
                     const MoeOptions& options = layer.options;
                     Buffer &x = layer.x, &router = layer.router, &bias = layer.bias, &g_out = layer.g_out;
                     Buffer &gate_up = layer.gate_up, &gate_up_bias = layer.gate_up_bias, &down = layer.down,
                            &down_bias = layer.down_bias;
                     const int64_t r = 2, rE = r * d.E;
                     Buffer gu_a(rE * d.C, m, 11), gu_b(2 * d.F * rE, m, 12), dn_a(rE * d.F, m, 13), dn_b(d.C * rE, m, 14);
                     const MoeStackedLora lora{gu_a.data(), gu_b.data(), r, 0.75f, dn_a.data(), dn_b.data(), r, 1.5f};
                     const MoeStacked w{gate_up.data(), gate_up_bias.data(), down.data(), down_bias.data(), &lora};
                     Buffer out(n * d.C, m, 9);
                     MoeSaved saved;
                     if (auto ok = layer.forward(w, out, saved); !ok) return ok;
                     const float nan = std::numeric_limits<float>::quiet_NaN();
                     const std::vector<int64_t> sizes = {n * d.C, d.E * d.C, d.E, d.E * 2 * d.F, d.E * d.C,
                                                         rE * d.C, 2 * d.F * rE, rE * d.F, d.C * rE};
                     std::vector<std::vector<float>> fast, want, stored;
                     for (int64_t size : sizes) {
                       fast.emplace_back(static_cast<size_t>(size), nan);  // every element must be written
                       want.emplace_back(static_cast<size_t>(size), 0.0f);
                       stored.emplace_back(static_cast<size_t>(size), nan);
                     }
                     auto grads = [](std::vector<std::vector<float>>& g) {
                       MoeStackedGrads out{nullptr, g[3].data(), nullptr, g[4].data()};
                       out.lora = {g[5].data(), g[6].data(), g[7].data(), g[8].data()};
                       return out;
                     };
                     moe_backward(d, options, x.data(), router.data(), bias.data(), w, saved, g_out.data(),
                                  fast[0].data(), fast[1].data(), fast[2].data(), grads(fast));
                     moe_backward_reference(d, options, x.data(), router.data(), bias.data(), w, g_out.data(),
                                            want[0].data(), want[1].data(), want[2].data(), grads(want));
                     const char* names[] = {"dx", "d_router", "d_router_bias", "d_gate_up_bias", "d_down_bias",
                                            "d gate_up lora_A", "d gate_up lora_B", "d down lora_A", "d down lora_B"};
                     for (size_t i = 0; i < fast.size(); ++i)
                       if (auto ok = close(fast[i].data(), want[i].data(), static_cast<int64_t>(fast[i].size()), 1e-4, 1e-5); !ok)
                         return ok << " (" << names[i] << ")";
                     // The stored form: each expert's output rows, gate_up (2F × C) and down (C × F)
                     std::vector<float> gu_rows(static_cast<size_t>(d.E * 2 * d.F * d.C)), dn_rows(static_cast<size_t>(d.E * d.C * d.F));
                     std::vector<WeightView> gu_views, dn_views;
                     for (int64_t e = 0; e < d.E; ++e) {
                       for (int64_t c = 0; c < d.C; ++c) {
                         for (int64_t j = 0; j < 2 * d.F; ++j)
                           gu_rows[static_cast<size_t>((e * 2 * d.F + j) * d.C + c)] = gate_up.data()[(e * d.C + c) * 2 * d.F + j];
                         for (int64_t f = 0; f < d.F; ++f)
                           dn_rows[static_cast<size_t>((e * d.C + c) * d.F + f)] = down.data()[(e * d.F + f) * d.C + c];
                       }
                       gu_views.push_back({WeightType::F32, gu_rows.data() + e * 2 * d.F * d.C, 2 * d.F, d.C});
                       dn_views.push_back({WeightType::F32, dn_rows.data() + e * d.C * d.F, d.C, d.F});
                     }
                     const MoeStackedStored sw{gu_views.data(), gate_up_bias.data(), dn_views.data(), down_bias.data(), &lora};
                     Buffer out2(n * d.C, m, 15);
                     MoeSaved saved2;
                     moe_forward(d, options, x.data(), router.data(), bias.data(), sw, out2.data(), saved2);
                     if (auto ok = close(out2.data(), out.data(), n * d.C, 1e-5, 1e-6); !ok) return ok << " (stored: out)";
                     moe_backward(d, options, x.data(), router.data(), bias.data(), sw, saved2, g_out.data(),
                                  stored[0].data(), stored[1].data(), stored[2].data(), grads(stored));
                     for (size_t i = 0; i < stored.size(); ++i)
                       if (auto ok = close(stored[i].data(), fast[i].data(), static_cast<int64_t>(stored[i].size()), 1e-4, 1e-5); !ok)
                         return ok << " (stored: " << names[i] << ")";
                     return ::testing::AssertionSuccess();
                   }});
  // A query that sees one key (T = 1, or a window of 1: every row here) has a softmax of exactly 1 whatever its score,
  // so its dS is exactly 0 and dQ and dK are exactly 0, as PyTorch gives them: G − Di (dO·V from a tile product,
  // dO·O from a dot) agrees only to rounding, which became a W_query gradient of 1e-6…1e-4 (issue 44 item 18).
  // O = V and dV = dO exactly too. Scores of every size: inputs scaled by 1 and 16.
  cases.push_back({"attention, one visible key: dS, dQ and dK exactly 0", [](int64_t n, int m) {
                     if (n == 0 || n > 257) return ::testing::AssertionSuccess();  // every block shape by 257
                     for (const float scale : {1.0f, 16.0f})
                       for (const int64_t D : {2, 5}) {
                         const AttentionDims d{2, 1, n, n, D, 1};
                         AttentionLayout l;
                         l.q = l.o = l.k = l.v = AttentionStrides::bhtd(d, n);
                         AttentionOptions o;
                         o.causal = true;
                         o.window = 1;
                         const int64_t size = 2 * n * D;
                         Buffer q(size, m, 1, scale), k(size, m, 2, scale), v(size, m, 3, scale), out(size, m, 4),
                             lse(2 * n, m, 6), g(size, m, 7), dq(size, m, 8), dk(size, m, 9), dv(size, m, 10);
                         attention_forward(d, l, o, q.data(), k.data(), v.data(), out.data(), lse.data());
                         attention_backward(d, l, o, q.data(), k.data(), v.data(), out.data(), lse.data(), g.data(),
                                            dq.data(), dk.data(), dv.data());
                         for (int64_t i = 0; i < size; ++i) {
                           if (out.data()[i] != v.data()[i] || dv.data()[i] != g.data()[i] || dq.data()[i] != 0.0f ||
                               dk.data()[i] != 0.0f)
                             return ::testing::AssertionFailure()
                                    << "D = " << D << ", scale " << scale << ", element " << i << ": O " << out.data()[i]
                                    << " (V " << v.data()[i] << "), dV " << dv.data()[i] << " (dO " << g.data()[i]
                                    << "), dQ " << dq.data()[i] << ", dK " << dk.data()[i];
                         }
                       }
                     return ::testing::AssertionSuccess();
                   }});
  // Generation's attention over a paged cache read in place: n positions in pages of up to 16 (the first one short,
  // as a sliding window starts inside a block), rows with spare bytes between them, each storage type, grouped-query
  // heads, sinks and soft-capping in turn; against the double reference, the fused kernel (float32 rows), itself on 1
  // and 3 threads, and (narrower types, widened as they are read, or a chunk of positions at a time in the plain C++
  // build) the same rows stored as float32, bit for bit.
  cases.push_back({"attention_decode over KV pages (f32, f16, bf16, q8_0; sinks, soft-capping)", [](int64_t n, int m) {
                     if (n == 0 || n > 257) return ::testing::AssertionSuccess();
                     const std::tuple<WeightType, int64_t> types[] = {
                         {WeightType::F32, 5}, {WeightType::F16, 20}, {WeightType::BF16, 40}, {WeightType::Q8_0, 64}};
                     for (const auto& [type, D] : types) {
                       const int64_t H = 4, H_kv = 2, W = H_kv * D, stride = row_bytes(type, W) + 4 * m + 8;
                       const AttentionDims d{1, H, 1, n, D, H_kv};
                       AttentionOptions o;
                       Buffer sinks(H, m, 14, 3.0f);
                       if (n % 3 == 1) o.sinks = sinks.data();
                       if (n % 3 == 2) o.softcap = 1.5f;
                       Buffer q(H * D, m, 1, 2.0f), k(n * W, m, 2, 2.0f), v(n * W, m, 3), out(H * D, m, 4), ref(H * D, m, 5);
                       std::vector<unsigned char> rows(static_cast<size_t>(2 * n * stride + 64));
                       unsigned char* keys = rows.data() + 4 * m;
                       unsigned char* values = keys + n * stride;
                       for (int64_t t = 0; t < n; ++t) {
                         quantize_rows(type, k.data() + t * W, keys + t * stride, 1, W);
                         quantize_rows(type, v.data() + t * W, values + t * stride, 1, W);
                       }
                       std::vector<KVPage> pages;
                       for (int64_t t = 0; t < n;) {
                         const int64_t count = std::min(n - t, t == 0 ? 1 + n % 16 : 16);
                         pages.push_back({keys + t * stride, values + t * stride, count});
                         t += count;
                       }
                       const KVPages kv{pages, type, stride};
                       attention_decode(d, o, q.data(), kv, out.data());
                       attention_decode_reference(d, o, q.data(), kv, ref.data());
                       const std::string what = std::string(" (") + weight_type_name(type) + ")";
                       if (auto ok = close(out.data(), ref.data(), H * D, 1e-5, 1e-6); !ok) return ok << what;
                       for (const int threads : {1, 3}) {
                         AttentionOptions fixed = o;
                         fixed.threads = threads;
                         Buffer again(H * D, m, 6);
                         attention_decode(d, fixed, q.data(), kv, again.data());
                         if (std::memcmp(again.data(), out.data(), sizeof(float) * H * D) != 0)
                           return ::testing::AssertionFailure() << threads << " threads changed the bits" << what;
                       }
                       if (type != WeightType::F32) {  // narrow rows widened: the bits of the same rows stored as float32
                         std::vector<float> wide(static_cast<size_t>(2 * n * W));
                         for (int64_t t = 0; t < n; ++t) {
                           dequantize_rows(type, keys + t * stride, wide.data() + t * W, 1, W);
                           dequantize_rows(type, values + t * stride, wide.data() + (n + t) * W, 1, W);
                         }
                         std::vector<KVPage> wide_pages;
                         for (const KVPage& page : pages) {
                           const int64_t t = (static_cast<const unsigned char*>(page.keys) - keys) / stride;
                           wide_pages.push_back({wide.data() + t * W, wide.data() + (n + t) * W, page.positions});
                         }
                         Buffer f32(H * D, m, 9);
                         attention_decode(d, o, q.data(), KVPages{wide_pages, WeightType::F32, W * int64_t{sizeof(float)}},
                                          f32.data());
                         if (std::memcmp(f32.data(), out.data(), sizeof(float) * H * D) != 0)
                           return ::testing::AssertionFailure() << "differs from its rows widened to float32" << what;
                       }
                       if (type == WeightType::F32) {  // the fused kernel's last query row over the same keys
                         AttentionLayout l;
                         l.q = l.o = AttentionStrides::btc(H, D, 1);
                         l.k = l.v = AttentionStrides::btc(H_kv, D, n);
                         o.causal = true;
                         std::vector<float> flat_k(static_cast<size_t>(n * W)), flat_v(flat_k.size());
                         for (int64_t t = 0; t < n; ++t) {
                           std::memcpy(flat_k.data() + t * W, keys + t * stride, sizeof(float) * W);
                           std::memcpy(flat_v.data() + t * W, values + t * stride, sizeof(float) * W);
                         }
                         Buffer fused(H * D, m, 7), lse(H, m, 8);
                         attention_forward(d, l, o, q.data(), flat_k.data(), flat_v.data(), fused.data(), lse.data());
                         if (auto ok = close(out.data(), fused.data(), H * D, 1e-5, 1e-6); !ok) return ok << " (against the fused kernel)";
                       }
                     }
                     return ::testing::AssertionSuccess();
                   }});
  return cases;
}

void PrintTo(const KernelCase& c, std::ostream* os) { *os << c.name; }

class KernelTable : public ::testing::TestWithParam<KernelCase> {};

TEST_P(KernelTable, MatchesItsReferenceForEverySizeAndMisalignment) {
  std::vector<int64_t> sizes(18);
  std::iota(sizes.begin(), sizes.end(), 0);
  for (int64_t odd : {31, 33, 127, 257, 1023}) sizes.push_back(odd);
  for (int64_t n : sizes)
    for (int misalign : {0, 1, 3}) EXPECT_TRUE(GetParam().check(n, misalign)) << GetParam().name << " n=" << n << " misalign=" << misalign;
}

INSTANTIATE_TEST_SUITE_P(Kernels, KernelTable, ::testing::ValuesIn(kernel_cases()),
                         [](const ::testing::TestParamInfo<KernelCase>& info) {
                           std::string name;
                           for (char c : std::string(info.param.name)) name += std::isalnum(static_cast<unsigned char>(c)) ? c : '_';
                           return name + "_" + std::to_string(info.index);
                         });

// ---- every differentiable op, against central differences ----

using Inputs = std::vector<Tensor>;
struct OpCase {
  const char* name;
  std::function<Tensor(const Inputs&)> f;
  std::vector<Tensor> inputs;
};

Tensor positive(const Shape& s, uint64_t seed) {
  Tensor t = random_tensor(s, seed);
  for (float& v : t.values()) v = 1.5f + std::fabs(v);  // away from 0 for log and division
  return t;
}

std::vector<OpCase> op_cases() {
  const std::vector<int64_t> targets = {2, -100, 0, 4};
  const std::vector<int64_t> ids = {3, 0, 3, 1, 4, 3};
  const std::vector<int64_t> tied_ids = {3, 0, 3, 1};
  const auto rope_table = std::make_shared<const kernels::RopeTable>(
      kernels::RopeTable::make(kernels::RopeFrequencies{.theta = 100.0}.inverse_frequencies(4), 10));
  kernels::RopeFrequencies half{.theta = 100.0};
  half.rotary_dim = 2;  // of heads of 4
  const auto partial_table = std::make_shared<const kernels::RopeTable>(kernels::RopeTable::make(half.inverse_frequencies(4), 10));
  AttentionConfig causal_heads;
  causal_heads.num_heads = 2;
  causal_heads.causal = true;
  AttentionConfig bhtd;
  return {
      {"matmul 2-D", [](const Inputs& x) { return matmul(x[0], x[1]); }, {random_tensor({3, 4}, 1), random_tensor({4, 5}, 2)}},
      {"matmul batched", [](const Inputs& x) { return matmul(x[0], x[1]); }, {random_tensor({2, 3, 3, 4}, 1), random_tensor({2, 3, 4, 2}, 2)}},
      {"matmul shared right", [](const Inputs& x) { return matmul(x[0], x[1]); }, {random_tensor({2, 5, 3}, 1), random_tensor({3, 4}, 2)}},
      {"matmul shared left", [](const Inputs& x) { return matmul(x[0], x[1]); }, {random_tensor({3, 4}, 1), random_tensor({2, 4, 2}, 2)}},
      {"linear", [](const Inputs& x) { return linear(x[0], x[1], x[2]); }, {random_tensor({2, 3, 4}, 1), random_tensor({5, 4}, 2), random_tensor({5}, 3)}},
      {"linear without bias", [](const Inputs& x) { return linear(x[0], x[1], Tensor()); }, {random_tensor({3, 4}, 1), random_tensor({2, 4}, 2)}},
      {"transpose last two", [](const Inputs& x) { return transpose(x[0], -2, -1); }, {random_tensor({2, 3, 4}, 1)}},
      {"transpose middle", [](const Inputs& x) { return transpose(x[0], 1, 2); }, {random_tensor({2, 3, 4, 5}, 1)}},
      {"reshape", [](const Inputs& x) { return reshape(x[0], {3, -1}); }, {random_tensor({2, 3, 2}, 1)}},
      {"add same", [](const Inputs& x) { return add(x[0], x[1]); }, {random_tensor({2, 3, 4}, 1), random_tensor({2, 3, 4}, 2)}},
      {"add row", [](const Inputs& x) { return add(x[0], x[1]); }, {random_tensor({2, 3, 4}, 1), random_tensor({4}, 2)}},
      {"sub column×row", [](const Inputs& x) { return sub(x[0], x[1]); }, {random_tensor({2, 3, 1}, 1), random_tensor({1, 3, 4}, 2)}},
      {"sub row", [](const Inputs& x) { return sub(x[0], x[1]); }, {random_tensor({2, 3, 4}, 1), random_tensor({3, 4}, 2)}},
      {"mul same", [](const Inputs& x) { return mul(x[0], x[1]); }, {random_tensor({2, 3, 4}, 1), random_tensor({2, 3, 4}, 2)}},
      {"mul row", [](const Inputs& x) { return mul(x[0], x[1]); }, {random_tensor({2, 3, 4}, 1), random_tensor({4}, 2)}},
      {"mul column×row", [](const Inputs& x) { return mul(x[0], x[1]); }, {random_tensor({2, 3, 1}, 1), random_tensor({1, 3, 4}, 2)}},
      {"div row", [](const Inputs& x) { return div(x[0], x[1]); }, {random_tensor({2, 3, 4}, 1), positive({4}, 3)}},
      {"scalar arithmetic", [](const Inputs& x) { return (x[0] * 3.0f + 1.0f) / 2.0f - 0.5f; }, {random_tensor({5}, 1)}},
      {"neg and exp", [](const Inputs& x) { return exp(neg(x[0])); }, {random_tensor({5}, 1)}},
      {"log", [](const Inputs& x) { return log(x[0]); }, {positive({5}, 2)}},
      {"soft_cap", [](const Inputs& x) { return soft_cap(mul(x[0], 4.0f), 3.0f); }, {random_tensor({2, 5}, 1)}},
      {"sigmoid", [](const Inputs& x) { return sigmoid(mul(x[0], 3.0f)); }, {random_tensor({2, 5}, 1)}},
      // softplus on both sides of 20, where torch's returns x itself
      {"softplus", [](const Inputs& x) { return softplus(add(mul(x[0], 3.0f), x[1])); },
       {random_tensor({2, 5}, 1), Tensor::from({-4.0f, 0.5f, 3.0f, 19.0f, 24.0f}, Shape{5})}},
      {"narrow", [](const Inputs& x) { return narrow(x[0], 1, 3); }, {random_tensor({2, 3, 5}, 1)}},
      {"sum all", [](const Inputs& x) { return sum(x[0]); }, {random_tensor({2, 3}, 1)}},
      {"sum dim", [](const Inputs& x) { return sum(x[0], 1, true); }, {random_tensor({2, 3, 4}, 1)}},
      {"mean all", [](const Inputs& x) { return mean(x[0]); }, {random_tensor({2, 3}, 1)}},
      {"mean dim", [](const Inputs& x) { return mean(x[0], 0); }, {random_tensor({2, 3, 4}, 1)}},
      {"softmax", [](const Inputs& x) { return softmax(x[0]); }, {random_tensor({3, 6}, 1)}},
      {"softmax tail of 11", [](const Inputs& x) { return softmax(x[0]); }, {random_tensor({2, 11}, 4, 3.0f)}},
      {"cross_entropy with ignored rows", [targets](const Inputs& x) { return cross_entropy(x[0], targets); }, {random_tensor({4, 5}, 1)}},
      {"linear_cross_entropy with ignored rows", [targets](const Inputs& x) { return linear_cross_entropy(x[0], x[1], x[2], targets); },
       {random_tensor({2, 2, 3}, 1), random_tensor({5, 3}, 2), random_tensor({5}, 3)}},
      {"linear_cross_entropy with a tied head (the table embeds the rows)", [targets, tied_ids](const Inputs& x) {
         return linear_cross_entropy(embedding(x[0], tied_ids, Shape{4}), x[0], Tensor(), targets); },
       {random_tensor({5, 3}, 1)}},
      {"masked_fill then softmax", [](const Inputs& x) { return softmax(masked_fill(x[0], causal_mask(4), -INFINITY)); }, {random_tensor({2, 4, 4}, 1)}},
      {"concat", [](const Inputs& x) { return concat({x[0], x[1]}, -1); }, {random_tensor({2, 3, 2}, 1), random_tensor({2, 3, 4}, 2)}},
      {"dropout (torch masks)", [](const Inputs& x) { Generator gen(7); return dropout(x[0], 0.4, true, gen); }, {random_tensor({4, 5}, 1)}},
      {"hashed_dropout", [](const Inputs& x) { Generator gen(7); return hashed_dropout(x[0], 0.4, true, gen); }, {random_tensor({4, 9}, 1)}},
      {"embedding", [ids](const Inputs& x) { return embedding(x[0], ids, Shape{2, 3}); }, {random_tensor({5, 4}, 1)}},
      {"layer_norm", [](const Inputs& x) { return layer_norm(x[0], x[1], x[2]); }, {random_tensor({3, 7}, 1), positive({7}, 2), random_tensor({7}, 3)}},
      {"gelu", [](const Inputs& x) { return gelu(x[0]); }, {random_tensor({3, 11}, 1, 2.0f)}},
      {"rms_norm", [](const Inputs& x) { return rms_norm(x[0], x[1], 1e-6f); }, {random_tensor({3, 7}, 1), random_tensor({7}, 2)}},
      {"rms_norm (1 + w)", [](const Inputs& x) { return rms_norm(x[0], x[1], 1e-6f, 1.0f); }, {random_tensor({2, 3, 5}, 1), random_tensor({5}, 2)}},
      {"silu", [](const Inputs& x) { return silu(x[0]); }, {random_tensor({3, 11}, 1, 3.0f)}},
      {"rope rotate-half at position 3", [rope_table](const Inputs& x) { return rope(x[0], rope_table, kernels::RopeLayout::RotateHalf, 2, 3); },
       {random_tensor({2, 4, 8}, 1)}},
      {"rope on the q and k heads of a packed projection", [rope_table](const Inputs& x) { return rope(x[0], rope_table, kernels::RopeLayout::RotateHalf, 4, 1, 3); },
       {random_tensor({2, 3, 16}, 1)}},
      {"rope interleaved", [rope_table](const Inputs& x) { return rope(x[0], rope_table, kernels::RopeLayout::Interleaved, 2); },
       {random_tensor({1, 5, 8}, 1)}},
      // partial RoPE in its two published forms: the first half of each head rotated by halves (Phi-3, NeoX) or by
      // interleaved pairs (GLM-4, GPT-J), the other half passed through
      {"rope partial rotate-half", [partial_table](const Inputs& x) { return rope(x[0], partial_table, kernels::RopeLayout::RotateHalf, 2, 2); },
       {random_tensor({2, 5, 8}, 1)}},
      {"rope partial interleaved", [partial_table](const Inputs& x) { return rope(x[0], partial_table, kernels::RopeLayout::Interleaved, 2, 2); },
       {random_tensor({2, 5, 8}, 1)}},
      {"scaled_dot_product_attention (B,T,H·D) causal", [causal_heads](const Inputs& x) { return scaled_dot_product_attention(x[0], x[1], x[2], causal_heads); },
       {random_tensor({2, 5, 6}, 1), random_tensor({2, 5, 6}, 2), random_tensor({2, 5, 6}, 3)}},
      {"scaled_dot_product_attention packed (B,T,3·H·D) causal", [causal_heads](const Inputs& x) { return scaled_dot_product_attention(x[0], causal_heads); },
       {random_tensor({2, 5, 18}, 1)}},
      {"linear_concat of three layers", [](const Inputs& x) { return linear_concat(x[0], std::vector<Tensor>{x[1], x[2], x[3]}, std::vector<Tensor>{x[4], x[5], x[6]}); },
       {random_tensor({2, 3, 4}, 1), random_tensor({3, 4}, 2), random_tensor({2, 4}, 3), random_tensor({5, 4}, 4),
        random_tensor({3}, 5), random_tensor({2}, 6), random_tensor({5}, 7)}},
      {"lora_linear (x Wᵀ + b + 2·(x Aᵀ) Bᵀ)", [](const Inputs& x) { return lora_linear(x[0], x[1], x[2], x[3], x[4], 2.0f); },
       {random_tensor({2, 3, 4}, 1), random_tensor({5, 4}, 2), random_tensor({5}, 3), random_tensor({2, 4}, 4), random_tensor({5, 2}, 5)}},
      {"lora_linear without bias, rank 1", [](const Inputs& x) { return lora_linear(x[0], x[1], Tensor(), x[2], x[3], 0.5f); },
       {random_tensor({3, 4}, 1), random_tensor({2, 4}, 2), random_tensor({1, 4}, 3), random_tensor({2, 1}, 4)}},
      {"linear_concat with low-rank updates on its first and last parts", [](const Inputs& x) {
         const std::vector<LowRankUpdate> up = {{x[4], x[5], 1.5f}, {}, {x[6], x[7], 0.5f}};
         return linear_concat(x[0], std::vector<Tensor>{x[1], x[2], x[3]}, {}, up); },
       {random_tensor({2, 3, 4}, 1), random_tensor({3, 4}, 2), random_tensor({2, 4}, 3), random_tensor({5, 4}, 4),
        random_tensor({2, 4}, 5), random_tensor({3, 2}, 6), random_tensor({1, 4}, 7), random_tensor({5, 1}, 8)}},
      {"gather_tokens (a classifier's pooled positions)", [](const Inputs& x) { return gather_tokens(x[0], std::vector<int64_t>{3, 0, 3}); },
       {random_tensor({3, 4, 2}, 1)}},
      {"linear_concat without biases", [](const Inputs& x) { return linear_concat(x[0], std::vector<Tensor>{x[1], x[2]}); },
       {random_tensor({3, 4}, 1), random_tensor({2, 4}, 2), random_tensor({3, 4}, 3)}},
      {"scaled_dot_product_attention grouped-query (B,H,T,D), window 2", [](const Inputs& x) {
         AttentionConfig c;
         c.causal = true;
         c.window = 2;
         return scaled_dot_product_attention(x[0], x[1], x[2], c); },
       {random_tensor({1, 4, 5, 3}, 1), random_tensor({1, 2, 5, 3}, 2), random_tensor({1, 2, 5, 3}, 3)}},
      {"scaled_dot_product_attention with sinks, grouped-query (B,T,H·D), causal", [](const Inputs& x) {
         AttentionConfig c;
         c.num_heads = 4;
         c.causal = true;
         c.sinks = x[3];
         return scaled_dot_product_attention(x[0], x[1], x[2], c); },
       {random_tensor({2, 5, 12}, 1), random_tensor({2, 5, 6}, 2), random_tensor({2, 5, 6}, 3), random_tensor({4}, 4, 2.0f)}},
      {"scaled_dot_product_attention packed, sinks, window 2", [](const Inputs& x) {
         AttentionConfig c;
         c.num_heads = 2;
         c.causal = true;
         c.window = 2;
         c.sinks = x[1];
         return scaled_dot_product_attention(x[0], c); },
       {random_tensor({1, 4, 18}, 1), random_tensor({2}, 2)}},
      {"attention_output_gate (Qwen3-Next: the gate from a doubled q projection)", [](const Inputs& x) {
         return attention_output_gate(x[0], x[1], 2); },
       {random_tensor({2, 3, 6}, 1), random_tensor({2, 3, 12}, 2, 2.0f)}},
      {"mixture_of_experts (3 experts, top-2, renormalised)", [](const Inputs& x) {
         MoeConfig c;
         c.experts_per_token = 2;
         return mixture_of_experts(x[0], x[1], std::vector<Tensor>{x[2], x[3], x[4]}, std::vector<Tensor>{x[5], x[6], x[7]},
                                   std::vector<Tensor>{x[8], x[9], x[10]}, c); },
       {random_tensor({2, 3, 4}, 1), random_tensor({3, 4}, 2, 3.0f), random_tensor({2, 4}, 3), random_tensor({2, 4}, 4),
        random_tensor({2, 4}, 5), random_tensor({2, 4}, 6), random_tensor({2, 4}, 7), random_tensor({2, 4}, 8),
        random_tensor({4, 2}, 9), random_tensor({4, 2}, 10), random_tensor({4, 2}, 11)}},
      {"mixture_of_experts (2 experts, top-1, not renormalised)", [](const Inputs& x) {
         MoeConfig c;
         c.experts_per_token = 1;
         c.norm_topk_prob = false;
         return mixture_of_experts(x[0], x[1], std::vector<Tensor>{x[2], x[3]}, std::vector<Tensor>{x[4], x[5]},
                                   std::vector<Tensor>{x[6], x[7]}, c); },
       {random_tensor({5, 3}, 21), random_tensor({2, 3}, 22, 3.0f), random_tensor({2, 3}, 23), random_tensor({2, 3}, 24),
        random_tensor({2, 3}, 25), random_tensor({2, 3}, 26), random_tensor({3, 2}, 27), random_tensor({3, 2}, 28)}},
      {"mixture_of_experts (DeepSeek-V3 router: sigmoid, bias, best 1 of 2 groups, top-2, x2.5)", [](const Inputs& x) {
         MoeConfig c;
         c.experts_per_token = 2;
         c.sigmoid = true;
         c.selection_bias = Tensor::from({0.3f, -0.2f, 0.1f, 0.0f}, Shape{4});
         c.groups = 2;
         c.groups_kept = 1;
         c.scaling = 2.5f;
         return mixture_of_experts(x[0], x[1], std::vector<Tensor>{x[2], x[3], x[4], x[5]},
                                   std::vector<Tensor>{x[6], x[7], x[8], x[9]}, std::vector<Tensor>{x[10], x[11], x[12], x[13]}, c); },
       {random_tensor({2, 3, 4}, 41), random_tensor({4, 4}, 42, 3.0f), random_tensor({2, 4}, 43), random_tensor({2, 4}, 44),
        random_tensor({2, 4}, 45), random_tensor({2, 4}, 46), random_tensor({2, 4}, 47), random_tensor({2, 4}, 48),
        random_tensor({2, 4}, 49), random_tensor({2, 4}, 50), random_tensor({4, 2}, 51), random_tensor({4, 2}, 52),
        random_tensor({4, 2}, 53), random_tensor({4, 2}, 54)}},
      {"mixture_of_experts (gpt-oss: router bias, top-2 then softmax, stacked experts with biases, clamped SwiGLU)",
       [](const Inputs& x) {
         MoeConfig c;
         c.experts_per_token = 2;
         c.top_k_then_softmax = true;
         c.swiglu_limit = 0.8f;
         return mixture_of_experts(x[0], x[1], x[2], x[3], x[4], x[5], x[6], c); },
       {random_tensor({2, 3, 4}, 61), random_tensor({3, 4}, 62, 3.0f), random_tensor({3}, 63), random_tensor({3, 4, 4}, 64),
        random_tensor({3, 4}, 65), random_tensor({3, 2, 4}, 66), random_tensor({3, 4}, 67)}},
      {"gated_delta_rule (2 heads, Dk 3, Dv 2)", [](const Inputs& x) {
         return gated_delta_rule(x[0], x[1], x[2], x[3], x[4]); },
       {random_tensor({1, 5, 2, 3}, 31), random_tensor({1, 5, 2, 3}, 32, 0.6f), random_tensor({1, 5, 2, 2}, 33),
        neg(positive({1, 5, 2}, 34)) * 0.2f, positive({1, 5, 2}, 35) * 0.3f}},
      // a cache's state before the first token (not an input: it gets no gradient)
      {"gated_delta_rule from a state", [](const Inputs& x) {
         return gated_delta_rule(x[0], x[1], x[2], x[3], x[4], random_tensor({1, 2, 3, 2}, 46)); },
       {random_tensor({1, 4, 2, 3}, 41), random_tensor({1, 4, 2, 3}, 42, 0.6f), random_tensor({1, 4, 2, 2}, 43),
        neg(positive({1, 4, 2}, 44)) * 0.2f, positive({1, 4, 2}, 45) * 0.3f}},
      {"causal_conv1d (K 4)", [](const Inputs& x) { return causal_conv1d(x[0], x[1]); },
       {random_tensor({2, 6, 3}, 51), random_tensor({3, 4}, 52)}},
      {"causal_conv1d after a state", [](const Inputs& x) { return causal_conv1d(x[0], x[1], random_tensor({1, 3, 3}, 55)); },
       {random_tensor({1, 3, 3}, 53), random_tensor({3, 4}, 54)}},
      {"scaled_dot_product_attention (B,H,T,D)", [bhtd](const Inputs& x) { return scaled_dot_product_attention(x[0], x[1], x[2], bhtd); },
       {random_tensor({1, 2, 4, 3}, 1), random_tensor({1, 2, 6, 3}, 2), random_tensor({1, 2, 6, 3}, 3)}},
  };
}

void PrintTo(const OpCase& c, std::ostream* os) { *os << c.name; }

class OpTable : public ::testing::TestWithParam<OpCase> {};

TEST_P(OpTable, GradientMatchesCentralDifferences) {
  EXPECT_TRUE(gradcheck(GetParam().f, GetParam().inputs)) << GetParam().name;
}

INSTANTIATE_TEST_SUITE_P(Ops, OpTable, ::testing::ValuesIn(op_cases()),
                         [](const ::testing::TestParamInfo<OpCase>& info) { return "op" + std::to_string(info.index); });

}  // namespace
}  // namespace qkv::test
