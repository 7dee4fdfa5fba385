// What 2025's attention variants cost beside the plain fused kernel, measured in one run: the forward with a sink
// logit per head, and with the output gate after it (issue 43's target: each ≤ 5% over the plain forward); and a
// mixture-of-experts layer (k of E experts per token) against a dense SwiGLU with the same active parameters; Gated
// DeltaNet's decoding step after a short and a long context, and its forward + backward (recurrent and chunked forms)
// against the FMA peak (run with OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE unset: the chunked form's products are sgemm's).
// Medians of repeats, ratios taken in the same run. A plain program: `qkv_attention_variants_bench [--smoke]`.
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <vector>

#include "qkv/core/random.hpp"
#include "qkv/kernels/gemm.hpp"
#include "peak.hpp"
#include "qkv/kernels.hpp"

namespace {

using namespace qkv::kernels;

// The median of `reps` timed runs of each of fs, in seconds, the runs alternating between them (a shared machine's
// load drifts: alternating puts each variant under the same drift), one untimed warm-up of each first.
std::vector<double> median_seconds(int reps, const std::vector<std::function<void()>>& fs) {
  for (const auto& f : fs) f();
  std::vector<std::vector<double>> times(fs.size());
  for (int r = 0; r < reps; ++r)
    for (size_t i = 0; i < fs.size(); ++i) {
      const auto start = std::chrono::steady_clock::now();
      fs[i]();
      times[i].push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    }
  std::vector<double> medians;
  for (auto& t : times) {
    std::sort(t.begin(), t.end());
    medians.push_back(t[t.size() / 2]);
  }
  return medians;
}

std::vector<float> random_floats(int64_t n, uint64_t seed, float scale = 1.0f) {
  qkv::Generator gen(seed);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = gen.uniform_float(-1.0f, 1.0f) * scale;
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  const bool smoke = argc > 1 && std::strcmp(argv[1], "--smoke") == 0;
  const int reps = smoke ? 1 : 15;
  const int threads = omp_get_max_threads();
  std::printf("attention variants, %d threads, kernels %s\n", threads, attention_isa());

  // ---- sinks and the gate on the fused forward: (B, H, T, D) = (1, 16, T, 64), causal, (B, T, H·D) layout ----
  const int64_t H = 16, D = 64, T = smoke ? 64 : 2048;
  const AttentionDims dims{1, H, T, T, D, H};
  AttentionLayout layout;
  layout.q = layout.k = layout.v = layout.o = AttentionStrides::btc(dims, T);
  const std::vector<float> q = random_floats(T * H * D, 1), k = random_floats(T * H * D, 2), v = random_floats(T * H * D, 3);
  const std::vector<float> sinks = random_floats(H, 4, 2.0f), gate = random_floats(T * 2 * H * D, 5, 2.0f);
  std::vector<float> o(static_cast<size_t>(T * H * D)), gated(o.size()), lse(static_cast<size_t>(H * T));
  AttentionOptions plain;
  plain.causal = true;
  AttentionOptions with_sinks = plain;
  with_sinks.sinks = sinks.data();
  const std::vector<double> attention_times = median_seconds(reps, {
      [&] { attention_forward(dims, layout, plain, q.data(), k.data(), v.data(), o.data(), lse.data()); },
      [&] { attention_forward(dims, layout, with_sinks, q.data(), k.data(), v.data(), o.data(), lse.data()); },
      [&] {
        attention_forward(dims, layout, plain, q.data(), k.data(), v.data(), o.data(), lse.data());
        attention_gate_forward(T, H, D, o.data(), gate.data() + D, 2 * H * D, 2 * D, gated.data());
      }});
  const double t_plain = attention_times[0], t_sinks = attention_times[1], t_gate = attention_times[2];
  const double flops = 2.0 * 2.0 * H * D * (T * (T + 1) / 2.0);  // QKᵀ and PV over the causal half
  std::printf("fused forward (1, %lld, %lld, %lld) causal: plain %.3f ms (%.1f GFLOP/s)\n", static_cast<long long>(H),
              static_cast<long long>(T), static_cast<long long>(D), t_plain * 1e3, flops / t_plain / 1e9);
  std::printf("  with sinks   %.3f ms  ratio to plain %.3f\n", t_sinks * 1e3, t_sinks / t_plain);
  std::printf("  with gate    %.3f ms  ratio to plain %.3f\n", t_gate * 1e3, t_gate / t_plain);

  // ---- a mixture of experts against a dense SwiGLU of the same active parameters ----
  const int64_t N = smoke ? 16 : 512, C = smoke ? 64 : 1024, E = 8, topk = 2, Fe = smoke ? 32 : 512;
  const MoeDims md{N, C, Fe, E, topk};
  const std::vector<float> x = random_floats(N * C, 6), router = random_floats(E * C, 7, 0.1f);
  std::vector<std::vector<float>> weights;
  for (int64_t i = 0; i < 3 * E; ++i) weights.push_back(random_floats(Fe * C, 10 + static_cast<uint64_t>(i), 0.05f));
  std::vector<const float*> g, u, d;
  for (int64_t e = 0; e < E; ++e) {
    g.push_back(weights[static_cast<size_t>(e)].data());
    u.push_back(weights[static_cast<size_t>(E + e)].data());
    d.push_back(weights[static_cast<size_t>(2 * E + e)].data());
  }
  std::vector<float> out(static_cast<size_t>(N * C));
  MoeSaved saved;

  // dense: inner width k·Fe, the active parameters of the MoE (router aside)
  const int64_t Fd = topk * Fe;
  const std::vector<float> dg = random_floats(Fd * C, 40, 0.05f), du = random_floats(Fd * C, 41, 0.05f), dd = random_floats(C * Fd, 42, 0.05f);
  std::vector<float> hg(static_cast<size_t>(N * Fd)), hu(hg.size());
  const std::vector<double> moe_times = median_seconds(reps, {
      [&] { moe_forward(md, MoeOptions{}, x.data(), router.data(), g.data(), u.data(), d.data(), out.data(), saved); },
      [&] {
        gemm(false, true, N, Fd, C, 1.0f, x.data(), C, dg.data(), C, 0.0f, hg.data(), Fd);
        gemm(false, true, N, Fd, C, 1.0f, x.data(), C, du.data(), C, 0.0f, hu.data(), Fd);
        silu_forward(hg.data(), hg.data(), N * Fd);
        for (size_t i = 0; i < hg.size(); ++i) hg[i] *= hu[i];
        gemm(false, true, N, C, Fd, 1.0f, hg.data(), Fd, dd.data(), Fd, 0.0f, out.data(), C);
      }});
  const double t_moe = moe_times[0], t_dense = moe_times[1];
  const double moe_flops = 2.0 * 3.0 * N * topk * Fe * C;
  std::printf("MoE forward N %lld, C %lld, %lld experts of %lld, top-%lld: %.3f ms (%.1f GFLOP/s on the active experts)\n",
              static_cast<long long>(N), static_cast<long long>(C), static_cast<long long>(E), static_cast<long long>(Fe),
              static_cast<long long>(topk), t_moe * 1e3, moe_flops / t_moe / 1e9);
  std::printf("  dense SwiGLU of the active width %lld: %.3f ms  MoE / dense %.3f\n", static_cast<long long>(Fd),
              t_dense * 1e3, t_moe / t_dense);

  // ---- decoding one token through experts kept as a GGUF keeps them: in place against widened ----
  // A Qwen3-30B-A3B-shaped layer (width 2048, experts of 768, top 8; 32 of its 128 experts, enough to choose from).
  // In place: kernels::moe_forward on the experts' stored rows (what the op runs). Widened: what it ran before, the
  // chosen experts dequantized to float32 for the call (into buffers made once), then the float32 kernel.
  const int64_t Cs = smoke ? 256 : 2048, Fs = smoke ? 256 : 768, Es = smoke ? 4 : 32, ks = smoke ? 2 : 8;
  const MoeDims sd{1, Cs, Fs, Es, ks};
  const std::vector<float> xs = random_floats(Cs, 50), rs = random_floats(Es * Cs, 51, 0.1f);
  const double bandwidth = qkv::bench::read_bandwidth(int64_t{256} << 20);
  std::printf("decoding 1 token through a MoE layer (C %lld, %lld experts of %lld, top-%lld); read bandwidth %.1f GB/s\n",
              static_cast<long long>(Cs), static_cast<long long>(Es), static_cast<long long>(Fs),
              static_cast<long long>(ks), bandwidth / 1e9);
  for (const WeightType type : {WeightType::Q8_0, WeightType::Q4_K}) {
    std::vector<std::vector<unsigned char>> stored;  // gate, up of each expert (F × C), then down (C × F)
    std::vector<WeightView> vg, vu, vd;
    for (int64_t i = 0; i < 3 * Es; ++i) {
      const bool is_down = i >= 2 * Es;
      const int64_t rows = is_down ? Cs : Fs, cols = is_down ? Fs : Cs;
      const std::vector<float> w = random_floats(rows * cols, 60 + static_cast<uint64_t>(i), 0.05f);
      stored.emplace_back(static_cast<size_t>(rows * row_bytes(type, cols)));
      quantize_rows(type, w.data(), stored.back().data(), rows, cols);
      (i < Es ? vg : i < 2 * Es ? vu : vd).push_back(WeightView{type, stored.back().data(), rows, cols});
    }
    std::vector<float> o(static_cast<size_t>(Cs));
    MoeSaved in_place_saved, wide_saved;
    moe_forward(sd, MoeOptions{}, xs.data(), rs.data(), vg.data(), vu.data(), vd.data(), o.data(), in_place_saved);
    std::vector<std::vector<float>> wide(static_cast<size_t>(3 * Es));
    // (experts no token chose are never read: their pointers stay null)
    std::vector<const float*> wg(static_cast<size_t>(Es), nullptr), wu = wg, wd = wg;
    const std::vector<double> t = median_seconds(smoke ? 1 : 31, {
        [&] { moe_forward(sd, MoeOptions{}, xs.data(), rs.data(), vg.data(), vu.data(), vd.data(), o.data(), in_place_saved); },
        [&] {
          for (int32_t e : in_place_saved.experts) {  // the token's chosen experts, widened for the call
            for (int p = 0; p < 3; ++p) {
              const WeightView& v = (p == 0 ? vg : p == 1 ? vu : vd)[static_cast<size_t>(e)];
              std::vector<float>& buffer = wide[static_cast<size_t>(p * Es + e)];
              buffer.resize(static_cast<size_t>(v.rows * v.cols));
              dequantize_rows(type, v.data, buffer.data(), v.rows, v.cols);
              (p == 0 ? wg : p == 1 ? wu : wd)[static_cast<size_t>(e)] = buffer.data();
            }
          }
          moe_forward(sd, MoeOptions{}, xs.data(), rs.data(), wg.data(), wu.data(), wd.data(), o.data(), wide_saved);
        }});
    const double bytes = static_cast<double>(ks) * 3.0 * static_cast<double>(Fs * row_bytes(type, Cs));
    std::printf("  %-5s in place %.3f ms (%.1f GB/s of the chosen experts' bytes, %.0f%% of the read bandwidth)  "
                "widened %.3f ms  in place / widened %.2fx faster\n",
                weight_type_name(type), t[0] * 1e3, bytes / t[0] / 1e9, 100.0 * bytes / t[0] / bandwidth, t[1] * 1e3,
                t[1] / t[0]);
  }

  // ---- Gated DeltaNet: decoding is flat in the context; forward + backward, recurrent and chunked, against the peak ----
  // Qwen3-Next's layer: 32 value heads of Dk = Dv = 128 (smoke: 4 heads of 16). A decoding step reads and writes each
  // head's (Dk × Dv) state, whatever the context that built it; a full-attention layer's step reads its whole KV cache.
  {
    const int64_t Hd = smoke ? 4 : 32, Dd = smoke ? 16 : 128;
    const double peak = qkv::bench::measure_fma_peak(threads, smoke ? 0.05 : 0.3) * 1e9;
    std::printf("Gated DeltaNet, %lld heads of Dk = Dv = %lld; FMA peak %.1f GFLOP/s\n", static_cast<long long>(Hd),
                static_cast<long long>(Dd), peak / 1e9);
    std::vector<double> per_token;
    const std::vector<int64_t> contexts = smoke ? std::vector<int64_t>{16, 64} : std::vector<int64_t>{256, 16384};
    for (const int64_t context : contexts) {
      // the state after `context` tokens (random q, k, v; decays near 1, as a long context keeps something)
      const DeltaRuleDims built{1, context, Hd, Dd, Dd};
      const auto q = random_floats(context * Hd * Dd, 31, 0.1f), k = random_floats(context * Hd * Dd, 32, 0.1f),
                 v = random_floats(context * Hd * Dd, 33);
      std::vector<float> g(static_cast<size_t>(context * Hd), -0.01f), beta(static_cast<size_t>(context * Hd), 0.5f);
      std::vector<float> o(static_cast<size_t>(context * Hd * Dd)), state(static_cast<size_t>(Hd * Dd * Dd));
      delta_rule_forward(built, q.data(), k.data(), v.data(), g.data(), beta.data(), nullptr, o.data(), state.data());
      // then one token at a time from it, as decoding runs (the state read and written back)
      const DeltaRuleDims step{1, 1, Hd, Dd, Dd};
      std::vector<float> next(state.size()), out(static_cast<size_t>(Hd * Dd));
      const int steps = smoke ? 4 : 64;
      const double t = median_seconds(reps, {[&] {
        for (int s = 0; s < steps; ++s) {
          delta_rule_forward(step, q.data(), k.data(), v.data(), g.data(), beta.data(), state.data(), out.data(), next.data());
          state.swap(next);
        }
      }})[0] / steps;
      per_token.push_back(t);
      const double kv = 2.0 * static_cast<double>(context) * 2 * 256 * 2;  // one attention layer: 2 K/V heads of 256, bf16
      std::printf("  decoding after %6lld tokens: %.1f µs a token (%.0f tokens/s); state %.2f MiB, a full-attention "
                  "layer's KV cache would be %.2f MiB\n", static_cast<long long>(context), t * 1e6, 1.0 / t,
                  static_cast<double>(state.size()) * 4 / 1048576.0, kv / 1048576.0);
    }
    std::printf("  tokens/s at %lld against %lld: %.3f (target: within 10%%)\n", static_cast<long long>(contexts[1]),
                static_cast<long long>(contexts[0]), per_token[0] / per_token[1]);
    // Training and prompts: forward and backward through T tokens (the recurrent form), counted as 6·Dk·Dv
    // floating-point operations a token and head forward (decay and read, update, output) and twice that backward.
    const int64_t Tt = smoke ? 128 : 4096, Ht = smoke ? 2 : 16;
    const DeltaRuleDims train{1, Tt, Ht, Dd, Dd};
    const auto q = random_floats(Tt * Ht * Dd, 41, 0.1f), k = random_floats(Tt * Ht * Dd, 42, 0.1f),
               v = random_floats(Tt * Ht * Dd, 43), d_o = random_floats(Tt * Ht * Dd, 44);
    std::vector<float> g(static_cast<size_t>(Tt * Ht), -0.01f), beta(static_cast<size_t>(Tt * Ht), 0.5f);
    std::vector<float> o(q.size()), dq(q.size()), dk(q.size()), dv(q.size()), dg(g.size()), db(g.size());
    std::vector<float> oc(q.size());
    const auto t = median_seconds(smoke ? 1 : 5, {
        [&] { delta_rule_forward(train, q.data(), k.data(), v.data(), g.data(), beta.data(), nullptr, o.data(), nullptr); },
        [&] {
          delta_rule_backward(train, q.data(), k.data(), v.data(), g.data(), beta.data(), nullptr, d_o.data(), dq.data(),
                              dk.data(), dv.data(), dg.data(), db.data());
        },
        [&] {
          delta_rule_forward_chunked(train, q.data(), k.data(), v.data(), g.data(), beta.data(), nullptr, oc.data(), nullptr);
        },
        [&] {
          delta_rule_backward_chunked(train, q.data(), k.data(), v.data(), g.data(), beta.data(), nullptr, d_o.data(),
                                      dq.data(), dk.data(), dv.data(), dg.data(), db.data());
        }});
    double apart = 0.0, largest = 0.0;
    for (size_t i = 0; i < o.size(); ++i) apart = std::max(apart, static_cast<double>(std::abs(o[i] - oc[i]))),
                                          largest = std::max(largest, static_cast<double>(std::abs(o[i])));
    // The chunked form's own count, per chunk of C tokens (Dk = Dv = D). Its solve: k·k and q·k (2 · 2·C²·D), (I + A)⁻¹
    // (C³/3), the two right-hand parts through it (2 · 2·C²·D), W S₀ (2·C·D²). The forward adds Q S₀ and the state's
    // update (2 · 2·C·D²) and the masked product (2·C²·D). The backward: a pass over the chunks for their starting
    // states (a solve and an update), the solve again, and its own products: seven of C × D × D (14·C·D²), eleven of
    // C × C × D (22·C²·D) and two of C × C × C (4·C³).
    const double C = kDeltaRuleChunk, chunks = static_cast<double>(Tt) / C * Ht;
    const double solve = 8.0 * C * C * Dd + C * C * C / 3.0 + 2.0 * C * Dd * Dd;
    const double chunk_flops = chunks * (solve + 4.0 * C * Dd * Dd + 2.0 * C * C * Dd);
    const double chunk_back = chunks * (2.0 * solve + 2.0 * C * Dd * Dd + 14.0 * C * Dd * Dd + 22.0 * C * C * Dd + 4.0 * C * C * C);
    const double flops = 6.0 * static_cast<double>(Tt * Ht * Dd * Dd);
    std::printf("  forward + backward, T %lld, %lld heads (recurrent form): %.1f ms + %.1f ms = %.1f GFLOP/s, %.0f%% of the "
                "FMA peak\n", static_cast<long long>(Tt), static_cast<long long>(Ht),
                t[0] * 1e3, t[1] * 1e3, 3.0 * flops / (t[0] + t[1]) / 1e9, 100.0 * 3.0 * flops / (t[0] + t[1]) / peak);
    std::printf("  forward, T %lld, %lld heads, chunked form (products by %s): %.1f ms, %.1f× "
                "the recurrent forward, %.1f GFLOP/s = %.0f%% of the FMA peak by its own count; outputs within %.1e of the "
                "largest\n", static_cast<long long>(Tt), static_cast<long long>(Ht), gemm_backend(), t[2] * 1e3, t[0] / t[2],
                chunk_flops / t[2] / 1e9, 100.0 * chunk_flops / t[2] / peak, apart / std::max(largest, 1e-30));
    std::printf("  forward + backward, T %lld, %lld heads, chunked form (training): %.1f ms + %.1f ms, %.1f× the recurrent "
                "form; %.1f GFLOP/s = %.0f%% of the FMA peak by its own count (target ≥ 50%%), %.0f%% by the recurrent "
                "form's\n", static_cast<long long>(Tt), static_cast<long long>(Ht), t[2] * 1e3, t[3] * 1e3,
                (t[0] + t[1]) / (t[2] + t[3]), (chunk_flops + chunk_back) / (t[2] + t[3]) / 1e9,
                100.0 * (chunk_flops + chunk_back) / (t[2] + t[3]) / peak, 100.0 * 3.0 * flops / (t[2] + t[3]) / peak);
  }
  return 0;
}
