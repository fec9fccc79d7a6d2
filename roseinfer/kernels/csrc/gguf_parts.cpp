// A GGUF layer's parts (see gguf_gemm.h): checking the stored tensors, building one
// kernel per run of same-type parts, running them into their output columns; and the
// dequantized rows of a stored tensor (embeddings).
#include <cstring>
#include <memory>

#include "act_quant.h"
#include "gguf_gemm.h"

namespace roseinfer {

namespace {

const char* type_name(int64_t t) {
  switch (t) {
    case kF16: return "F16";
    case kBF16: return "BF16";
    case kQ4_0: return "Q4_0";
    case kQ4_1: return "Q4_1";
    case kQ5_0: return "Q5_0";
    case kQ5_1: return "Q5_1";
    case kQ8_0: return "Q8_0";
    case kQ4_K: return "Q4_K";
    case kQ5_K: return "Q5_K";
    case kQ6_K: return "Q6_K";
    default: return "unsupported";
  }
}

void check_raw(const at::Tensor& raw) {
  TORCH_CHECK(raw.dim() == 2 && raw.scalar_type() == at::kByte && raw.device().is_cpu(),
              "GGUF part: expected a uint8 CPU tensor [rows, row_bytes]");
  TORCH_CHECK(raw.stride(1) == 1 && raw.stride(0) >= raw.size(1),
              "GGUF part: rows must be contiguous bytes");
}

// Q4_1 (Q4_0) stored rows -> (q int8 [n, K] in [0, 15], d, m fp32 [n, K/32]; Q4_0: m
// zeros) for Q8Gemm.
void unpack_q4(const std::vector<const uint8_t*>& rows, int64_t K, bool q4_0, at::Tensor& q,
               at::Tensor& d, at::Tensor& m) {
  const int64_t n = static_cast<int64_t>(rows.size()), KB = K / 32;
  q = at::empty({n, K}, at::TensorOptions().dtype(at::kChar));
  d = at::empty({n, KB}, at::TensorOptions().dtype(at::kFloat));
  m = at::empty({n, KB}, at::TensorOptions().dtype(at::kFloat));
  int8_t* qp = q.data_ptr<int8_t>();
  float* dp = d.data_ptr<float>();
  float* mp = m.data_ptr<float>();
  at::parallel_for(0, n, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t j = 0; j < KB; ++j) {
        const uint8_t* s = rows[r] + j * (q4_0 ? 18 : 20);
        const uint8_t* nib = s + (q4_0 ? 2 : 4);
        dp[r * KB + j] = f16_at(s);
        mp[r * KB + j] = q4_0 ? 0.f : f16_at(s + 2);
        for (int e = 0; e < 32; ++e)
          qp[r * K + j * 32 + e] = static_cast<int8_t>(e < 16 ? nib[e] & 15 : nib[e - 16] >> 4);
      }
  });
}

}  // namespace

int64_t gguf_row_values(int64_t type, int64_t row_bytes) {
  int64_t elems = 0, bytes = 0;
  TORCH_CHECK(ggml_block(type, elems, bytes), "GGUF: unsupported tensor type ", type);
  TORCH_CHECK(row_bytes > 0 && row_bytes % bytes == 0, "GGUF: a ", type_name(type),
              " row holds whole blocks of ", elems, " values (", bytes, " bytes each); ",
              row_bytes, " bytes is not a multiple of ", bytes);
  return row_bytes / bytes * elems;
}

GgufGemm::GgufGemm(const std::vector<int64_t>& types, const std::vector<at::Tensor>& raws,
                   bool act8, bool extra_copy) {
  TORCH_CHECK(!types.empty() && types.size() == raws.size(), "GgufGemm: one type per part");
  for (size_t i = 0; i < raws.size(); ++i) {
    check_raw(raws[i]);
    const int64_t k = gguf_row_values(types[i], raws[i].size(1));
    TORCH_CHECK(i == 0 || k == K, "GgufGemm: parts of ", K, " and ", k, " values per row");
    K = k;
  }
  for (size_t i = 0; i < raws.size();) {
    size_t e = i;
    std::vector<const uint8_t*> rows;
    for (; e < raws.size() && types[e] == types[i]; ++e)
      for (int64_t r = 0; r < raws[e].size(0); ++r)
        rows.push_back(raws[e].data_ptr<uint8_t>() + r * raws[e].stride(0));
    Segment seg;
    seg.type = types[i];
    seg.n0 = N;
    seg.n = static_cast<int64_t>(rows.size());
    if (seg.type == kF16 || seg.type == kBF16) {
      auto w = at::empty({seg.n, K}, at::TensorOptions().dtype(seg.type == kF16 ? at::kHalf : at::kBFloat16));
      for (int64_t r = 0; r < seg.n; ++r)
        std::memcpy(static_cast<uint8_t*>(w.data_ptr()) + r * K * 2, rows[r], K * 2);
      seg.panels = std::make_shared<PanelGemm>(w);
    } else if (act8 && (seg.type == kQ4_1 || seg.type == kQ4_0)) {
      at::Tensor q, d, m;
      const bool q4_0 = seg.type == kQ4_0;
      unpack_q4(rows, K, q4_0, q, d, m);
      seg.q4_1 = std::make_shared<Q8Gemm>(q, d, m, act8, extra_copy, q4_0 ? 8 : 0);
    } else {
      seg.quant = std::make_shared<GgufPanels>(seg.type, rows, K);
    }
    N += seg.n;
    segments.push_back(seg);
    i = e;
  }
}

void GgufGemm::run(const float* x, int64_t M, const float* bias, float* y, bool portable) const {
  if (M <= 0) return;
  std::unique_ptr<int16_t[]> xq;
  std::unique_ptr<float[]> dx, sx;
  for (const auto& seg : segments)
    if (seg.quant && !xq) {
      xq.reset(new int16_t[M * K]);
      dx.reset(new float[M * (K / 32)]);
      sx.reset(new float[M * (K / 32)]);
      quantize_rows(x, M, K, xq.get(), dx.get(), sx.get(), portable);
    }
  for (const auto& seg : segments) {
    const float* b = bias ? bias + seg.n0 : nullptr;
    if (seg.quant) {
      seg.quant->run(xq.get(), dx.get(), sx.get(), M, b, y + seg.n0, N, portable);
      continue;
    }
    const bool direct = segments.size() == 1;
    at::Tensor tmp;
    float* out = y;
    if (!direct) {
      tmp = at::empty({M, seg.n}, at::TensorOptions().dtype(at::kFloat));
      out = tmp.data_ptr<float>();
    }
    if (seg.panels) seg.panels->run(x, M, b, out, portable);
    else if (portable) seg.q4_1->run_reference(x, M, b, out);
    else seg.q4_1->run(x, M, b, out);
    if (!direct)
      for (int64_t m = 0; m < M; ++m)
        std::memcpy(y + m * N + seg.n0, out + m * seg.n, seg.n * sizeof(float));
  }
}

at::Tensor gguf_rows(const at::Tensor& raw, int64_t type, const at::Tensor& ids_) {
  check_raw(raw);
  const int64_t K = gguf_row_values(type, raw.size(1)), V = raw.size(0);
  const auto ids = ids_.to(at::kLong).contiguous().view({-1});
  const int64_t T = ids.numel();
  const int64_t* ip = ids.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(ip[t] >= 0 && ip[t] < V, "gguf_rows: id ", ip[t], " out of range [0, ", V, ")");
  at::Tensor out = at::empty({T, K}, at::TensorOptions().dtype(at::kFloat));
  float* op = out.data_ptr<float>();
  const uint8_t* base = raw.data_ptr<uint8_t>();
  const int64_t stride = raw.stride(0);
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const uint8_t* row = base + ip[t] * stride;
      float* o = op + t * K;
      if (type == kF16 || type == kBF16) {
        for (int64_t k = 0; k < K; ++k) {
          uint16_t h;
          std::memcpy(&h, row + 2 * k, 2);
          if (type == kF16) {
            o[k] = static_cast<float>(c10::Half(h, c10::Half::from_bits()));
          } else {
            const uint32_t bits = uint32_t(h) << 16;
            std::memcpy(o + k, &bits, 4);
          }
        }
      } else {
        with_format(type, [&](auto f) {
          using F = decltype(f);
          for (int64_t b = 0; b < K / F::E; ++b) F::dequant(row + b * F::kStored, o + b * F::E);
        });
      }
    }
  });
  return out;
}

}  // namespace roseinfer
