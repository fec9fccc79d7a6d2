// Greedy tokens from a GGUF Q8_0 LM head (see head_greedy.h).
#include "head_greedy.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <vector>

#include "act_quant.h"
#include "gguf_formats.h"
#include "gguf_rows.h"
#include "parallel_chunks.h"
#include "row_argmax.h"

namespace roseinfer {

namespace {

using F = FQ8_0;

// Steps of fewer rows take every logit exactly: their GEMV reads the weights at the
// memory's rate either way (Zen 4, 2 threads, the default model's head, ms: 2 rows 0.38
// against 0.54 with the int8 pass, 4 rows 0.63-0.76 against 0.74-0.83; 5 rows 0.82-0.89
// against 0.74-0.82, 8 rows 1.29 against 0.98, 16 2.55 against 1.67, 64 9.90 against 5.88).
constexpr int64_t kMinRows = 5;

// The exact (head) logits of one row, panels [p0, p1), into y (a row of the head's N):
// the head's own 1-row loop, whose bits every row count shares.
void exact_panels(const GgufPanels& g, const int16_t* xq, const float* dx, const float* sx,
                  int64_t p0, int64_t p1, float* y) {
#ifdef ROSEINFER_AVX2
  few_rows<F>(g, RowsArgs{xq, dx, sx, nullptr}, 1, p0, p1, nullptr, y, g.N);
#else
  (void)g, (void)xq, (void)dx, (void)sx, (void)p0, (void)p1, (void)y;
  TORCH_CHECK(false, "GreedyHead: not in this build");
#endif
}

#ifdef ROSEINFER_GREEDY_HEAD
// One panel's weights for the int8 pass, once for all rows: per 32-block the packed
// int8 weights with four per column in each 32-bit lane (the packing keeps two, the
// int16 loop's pairs: one vpermb per 64 bytes), -128 * their sums per column (the int8
// activations go in biased by 128: u8 = q + 128) and the fp32 scales.
struct PanelInt8 {
  std::vector<__m512i> w, neg_sum;
  std::vector<__m512> d;
  explicit PanelInt8(int64_t KB) : w(8 * KB), neg_sum(KB), d(KB) {}
  void load(const uint8_t* panel, int64_t KB) {
    alignas(64) uint8_t idx[64];
    for (int c = 0; c < 16; ++c)
      for (int i = 0; i < 4; ++i)
        idx[4 * c + i] = static_cast<uint8_t>(i < 2 ? 2 * c + i : 32 + 2 * c + i - 2);
    const __m512i perm = _mm512_load_si512(idx);
    const __m512i bias = _mm512_set1_epi8(static_cast<char>(0x80));
    for (int64_t j = 0; j < KB; ++j) {
      const uint8_t* blk = panel + j * F::kPanel;
      __m512i sum = _mm512_setzero_si512();
      for (int t = 0; t < 8; ++t) {
        w[8 * j + t] = _mm512_permutexvar_epi8(perm, _mm512_loadu_si512(blk + 64 * t));
        sum = _mm512_dpbusd_epi32(sum, bias, w[8 * j + t]);
      }
      neg_sum[j] = _mm512_sub_epi32(_mm512_setzero_si512(), sum);
      const auto* h = reinterpret_cast<const __m256i*>(blk + F::kScaleOff);
      d[j] = _mm512_cvtph_ps(_mm256_loadu_si256(h));
    }
  }
};

// The approximate logits of MR rows on one panel: at / dxt the rows' int8 activations
// + 128 and their scales (one per 32 values) in tile order (block j's MR rows of 32
// bytes, then block j + 1's: one pointer for every row), z the exact int32 dot of each
// 32-block, acc += float(z) * (d * dx).  ahead (or null): the next panel's packed
// weights, fetched a block per block.
template <int MR>
void approx_rows(const PanelInt8& pw, int64_t KB, const uint8_t* at, const float* dxt,
                 const uint8_t* ahead, __m512 (&acc)[MR]) {
  for (int m = 0; m < MR; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t j = 0; j < KB; ++j) {
    if (ahead)
      for (int64_t i = 0; i < F::kPanel; i += 64)
        _mm_prefetch(reinterpret_cast<const char*>(ahead + j * F::kPanel + i), _MM_HINT_T0);
    const __m512i* w = pw.w.data() + 8 * j;
    const int32_t* a = reinterpret_cast<const int32_t*>(at + j * MR * 32);
    __m512i z[MR];
    for (int m = 0; m < MR; ++m) z[m] = pw.neg_sum[j];
    for (int t = 0; t < 8; ++t) {
      const __m512i wt = _mm512_load_si512(w + t);
      for (int m = 0; m < MR; ++m)
        z[m] = _mm512_dpbusd_epi32(z[m], _mm512_set1_epi32(a[8 * m + t]), wt);
    }
    const float* dx = dxt + j * MR;
    for (int m = 0; m < MR; ++m)
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(z[m]),
                               _mm512_mul_ps(pw.d[j], _mm512_set1_ps(dx[m])), acc[m]);
  }
}
#endif  // ROSEINFER_GREEDY_HEAD

// The first maximum of y[c] over the head's columns of panel p, and its column.
inline void panel_max(const float* y, int64_t p, int64_t N, float& best, int64_t& id) {
  for (int64_t c = p * 16; c < std::min(N, p * 16 + 16); ++c)
    if (y[c] > best) best = y[c], id = c;
}

}  // namespace

GreedyHead::GreedyHead(std::shared_ptr<GgufPanels> p) : panels(std::move(p)) {
  TORCH_CHECK(panels && panels->type == kQ8_0, "GreedyHead: Q8_0 panels only");
  const GgufPanels& g = *panels;
  const int64_t KB = g.K / 32, NP = (g.N + 15) / 16;
  reach.assign(NP * KB, 0.f);
  at::parallel_for(0, NP, 16, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t j = 0; j < KB; ++j) {
        const uint8_t* blk = g.bytes + (p * KB + j) * F::kPanel;
        double most = 0.0;
        for (int c = 0; c < 16 && p * 16 + c < g.N; ++c) {
          int64_t s = 0;
          for (int e = 0; e < 32; ++e) s += std::abs(F::Ints::get(blk, c, e));
          const double d = F::scales(blk + F::kScaleOff, 0, c).d0;
          most = std::max(most, std::fabs(d) * s);
        }
        // rounded up: the bound stays a bound
        reach[p * KB + j] =
            std::nextafter(static_cast<float>(most), std::numeric_limits<float>::infinity());
      }
  });
  reach_max.assign(KB, 0.f);
  for (int64_t p = 0; p < NP; ++p)
    for (int64_t j = 0; j < KB; ++j) reach_max[j] = std::max(reach_max[j], reach[p * KB + j]);
}

bool GreedyHead::available() {
#ifdef ROSEINFER_GREEDY_HEAD
  return true;
#else
  return false;
#endif
}

std::tuple<at::Tensor, at::Tensor> GreedyHead::run(const at::Tensor& x_) const {
  TORCH_CHECK(available(), "GreedyHead: this build has no int8 pass (AVX-512 VNNI, VBMI)");
  const GgufPanels& g = *panels;
  const at::Tensor x = x_.contiguous();
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.size(1) == g.K,
              "GreedyHead: x must be float32 [M, ", g.K, "]");
  const int64_t M = x.size(0), K = g.K, KB = K / 32, N = g.N, NP = (N + 15) / 16;
  auto values = at::empty({M}, x.options());
  auto ids = at::empty({M}, x.options().dtype(at::kLong));
  if (M == 0) return {values, ids};
  const float* xp = x.data_ptr<float>();
  // The head's own int16 activations (GgufGemm::run's).
  std::vector<int16_t> q16(M * K);
  std::vector<float> dx16(M * KB), sx16(M * KB);
  quantize_rows(xp, M, K, q16.data(), dx16.data(), sx16.data(), false);
  float* vp = values.data_ptr<float>();
  int64_t* ip = ids.data_ptr<int64_t>();
  if (M < kMinRows) {  // bandwidth-bound: every logit as the head computes it
    std::unique_ptr<float[]> y(new float[M * N]);
    g.run(q16.data(), dx16.data(), sx16.data(), M, nullptr, y.get(), N, false);
    for (int64_t m = 0; m < M; ++m) std::tie(vp[m], ip[m]) = row_argmax(y.get() + m * N, N);
    return {values, ids};
  }
  // each row's approximate maximum per panel (max is exact in any order), [M, NP]
  std::unique_ptr<float[]> tops(new float[M * NP]);  // every value written below
  // int8 activations, one scale per 32 values (dx = max|x| / 127), biased by 128
  std::vector<int8_t> q8(M * K);
  std::vector<float> dx8(M * KB);
#ifdef ROSEINFER_GREEDY_HEAD
  at::parallel_for(0, M * KB, kQuantGrain, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      quantize_scalar<int8_t, 32>(xp + 32 * b, q8.data() + 32 * b, dx8.data() + b);
  });
  // + 128, in tile order: rows m0 .. m0 + mr - 1 (mr <= 8) at m0 * K, block by block
  std::vector<uint8_t> a8(M * K);
  std::vector<float> dx8t(M * KB);
  for (int64_t m0 = 0; m0 < M; m0 += 8) {
    const int64_t mr = std::min<int64_t>(8, M - m0);
    for (int64_t j = 0; j < KB; ++j)
      for (int64_t r = 0; r < mr; ++r) {
        dx8t[m0 * KB + j * mr + r] = dx8[(m0 + r) * KB + j];
        for (int64_t b = 0; b < 32; ++b)
          a8[m0 * K + (j * mr + r) * 32 + b] =
              static_cast<uint8_t>(q8[(m0 + r) * K + 32 * j + b]) ^ 0x80;
      }
  }
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 17) / (M * K * 16));
  parallel_chunks(NP, grain, [&](int64_t p0, int64_t p1) {
    PanelInt8 pw(KB);
    for (int64_t p = p0; p < p1; ++p) {
      pw.load(g.bytes + p * KB * F::kPanel, KB);
      for (int64_t m = 0; m < M; m += 8) {
        with_rows8(std::min<int64_t>(8, M - m), [&](auto rows) {
          constexpr int MR = decltype(rows)::value;
          __m512 acc[MR];
          const uint8_t* ahead =
              m == 0 && p + 1 < p1 ? g.bytes + (p + 1) * KB * F::kPanel : nullptr;
          approx_rows<MR>(pw, KB, a8.data() + m * K, dx8t.data() + m * KB, ahead, acc);
          const int64_t valid = std::min<int64_t>(16, N - p * 16);
          const __mmask16 cols = static_cast<__mmask16>((1u << valid) - 1);
          for (int r = 0; r < MR; ++r)
            tops[(m + r) * NP + p] = _mm512_mask_reduce_max_ps(cols, acc[r]);
        });
      }
    }
  });
#endif
  // rounding of both kernels' float sums (<= KB + 2 roundings each of sums below
  // reach * amax), well inside: gamma per unit of reach * amax
  const double gamma = 4.0 * (KB + 4) * std::ldexp(1.0, -23);
  at::parallel_for(0, M, 1, [&](int64_t m0, int64_t m1) {
    std::vector<float> exact(N);
    std::vector<double> slack(KB);
    for (int64_t m = m0; m < m1; ++m) {
      const int16_t* xq = q16.data() + m * K;
      const float* d16 = dx16.data() + m * KB;
      const float* s16 = sx16.data() + m * KB;
      const float* top = tops.get() + m * NP;
      auto whole_row = [&] {  // every logit as the head computes it, then its argmax
        exact_panels(g, xq, d16, s16, 0, NP, exact.data());
        std::tie(vp[m], ip[m]) = row_argmax(exact.data(), N);
      };
      double mag = 0.0;  // >= every |logit| and partial sum (sum_j reach_max_j * amax_j)
      for (int64_t j = 0; j < KB; ++j) {  // delta_j + the rounding share, per unit of reach
        double delta = 0.0, amax = 0.0;
        for (int64_t k = 32 * j; k < 32 * j + 32; ++k) {
          const double v16 = static_cast<double>(xq[k]) * d16[j];
          const double v8 = static_cast<double>(q8[m * K + k]) * dx8[m * KB + j];
          delta = std::max(delta, std::fabs(v16 - v8));
          amax = std::max(amax, std::fabs(static_cast<double>(xp[m * K + k])));
        }
        slack[j] = delta + gamma * amax;
        mag += amax * reach_max[j];
      }
      if (!(mag < 1e30)) {  // a NaN or inf in the row, or sums near fp32's overflow
        whole_row();
        continue;
      }
      int64_t pstar = 0;  // the first panel of the largest approximate logit
      for (int64_t p = 1; p < NP; ++p)
        if (top[p] > top[pstar]) pstar = p;
      exact_panels(g, xq, d16, s16, pstar, pstar + 1, exact.data());
      float e = -std::numeric_limits<float>::infinity();
      int64_t unused = -1;
      panel_max(exact.data(), pstar, N, e, unused);
      double widest = 0.0;  // the largest bound of any panel
      for (int64_t j = 0; j < KB; ++j) widest += slack[j] * reach_max[j];
      float best = -std::numeric_limits<float>::infinity();
      int64_t id = 0;
      for (int64_t p = 0; p < NP; ++p) {
        if (p != pstar) {
          if (static_cast<double>(top[p]) + widest * (1.0 + 1e-6) + 1e-6 < e) continue;
          double bound = 0.0;
          const float* r = reach.data() + p * KB;
          for (int64_t j = 0; j < KB; ++j) bound += slack[j] * r[j];
          if (static_cast<double>(top[p]) + bound * (1.0 + 1e-6) + 1e-6 < e) continue;
          exact_panels(g, xq, d16, s16, p, p + 1, exact.data());
        }
        panel_max(exact.data(), p, N, best, id);
      }
      vp[m] = best;
      ip[m] = id;
    }
  });
  return {values, ids};
}

}  // namespace roseinfer
