// LlamaStack step (see stack.h).
#include "stack.h"

#include <chrono>

#include "attention.h"
#include "rowops.h"

namespace roseinfer {

namespace {

// out_rows as a checked list (ascending rows of [0, B)).
std::vector<int64_t> kept_rows(const at::Tensor& out_rows, int64_t B) {
  std::vector<int64_t> keep;
  TORCH_CHECK(out_rows.scalar_type() == at::kLong && out_rows.dim() == 1,
              "out_rows must be a 1-D int64 tensor");
  const at::Tensor r = out_rows.contiguous();
  const int64_t* rp = r.data_ptr<int64_t>();
  for (int64_t i = 0; i < r.numel(); ++i) {
    TORCH_CHECK(rp[i] >= 0 && rp[i] < B && (i == 0 || rp[i] > rp[i - 1]),
                "out_rows must be ascending rows of the step's ", B);
    keep.push_back(rp[i]);
  }
  return keep;
}

}  // namespace

at::Tensor LlamaStack::run(at::Tensor h_in, at::Tensor positions, at::Tensor cos_sin,
                           std::vector<at::Tensor> kv_caches, at::Tensor block_tables,
                           at::Tensor token_seq, at::Tensor token_lens,
                           at::Tensor slot_mapping, int64_t block_size, const LoraStep* lora,
                           const at::Tensor* out_rows) {
  TORCH_CHECK((int64_t)kv_caches.size() == num_layers(), "one KV cache per layer");
  for (const auto& c : kv_caches) {
    check_decode_args(c, block_tables, token_lens);
    TORCH_CHECK(cache_head_dim(c) == Dh && c.size(2) == Hkv, "KV cache shape does not match");
  }
  check_token_seq(token_seq, block_tables, h_in.size(0));
  TORCH_CHECK(token_lens.numel() == h_in.size(0), "token_lens must have one entry per token");
  TORCH_CHECK(positions.scalar_type() == at::kLong && slot_mapping.scalar_type() == at::kLong,
              "positions and slot_mapping must be int64");
  const int64_t B = h_in.size(0);
  const int64_t q_size = H * Dh, kv_size = Hkv * Dh, qkv_size = q_size + 2 * kv_size;
  auto opts = h_in.options();
  at::Tensor h = h_in.contiguous().clone();
  at::Tensor x = at::empty({B, hidden}, opts), tmp = at::empty({B, hidden}, opts);
  at::Tensor qkv_buf = at::empty({B, qkv_size}, opts), attn = at::empty({B, q_size}, opts);
  at::Tensor qbuf = at::empty({B, q_size}, opts);
  at::Tensor gu = at::empty({B, 2 * inter}, opts), act = at::empty({B, inter}, opts);
  auto pos = positions.contiguous();
  auto slots = slot_mapping.contiguous();
  auto cs = cos_sin.contiguous();
  const int64_t* pp = pos.data_ptr<int64_t>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  const float* csp = cs.data_ptr<float>();
  float* hp = h.data_ptr<float>();
  float* xp = x.data_ptr<float>();
  float* tp = tmp.data_ptr<float>();
  float* qp = qkv_buf.data_ptr<float>();
  const float feps = (float)eps;
  const float scale = 1.f / std::sqrt((float)Dh);

  using clock = std::chrono::steady_clock;
  auto mark = clock::now();
  auto lap = [&](int which) {  // the time since the last lap, into times[which]
    if (!profiling) return 0.0;
    auto now = clock::now();
    const double dt = std::chrono::duration<double>(now - mark).count();
    times[which] += dt;
    mark = now;
    return dt;
  };
  // A linear's time: gemm, and its own counter (0-3: qkv, o, gate_up, down).
  auto lap_linear = [&](int which) { linear_times[which] += lap(0); };
  // The rows the last layer carries past its K/V writes (subset: fewer than all).
  const std::vector<int64_t> keep = out_rows ? kept_rows(*out_rows, B) : std::vector<int64_t>();
  const bool subset = out_rows && !lora && static_cast<int64_t>(keep.size()) < B;
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  const int32_t* lens = token_lens.data_ptr<int32_t>();
  const int32_t* seq_of = token_seq.data_ptr<int32_t>();
  std::vector<int32_t> kept_seq, kept_lens;  // the kept rows' (last layer)
  int64_t rows = B;  // rows past the K/V writes: B, then keep.size() in the last layer
  auto first = [&](const at::Tensor& t) { return t.narrow(0, 0, rows); };
  if (num_layers() > 0) rms_norm(hp, in_norm[0].data_ptr<float>(), xp, B, hidden, feps);
  for (int64_t l = 0; l < num_layers(); ++l) {
    lap(3);
    qkv[l]->run(x, qkv_buf);
    if (lora) lora->apply(l, 0, x, qkv_buf);
    lap_linear(0);
    const at::Tensor& cache = kv_caches[l];
    float* qg = qbuf.data_ptr<float>();
    const bool last_subset = subset && l + 1 == num_layers();
    with_kv_halves(cache, [&](auto* kc, auto* vc) {
      rope_and_store(qp, B, H, Hkv, Dh, pp, sp, csp, qg, kc, vc);
      lap(2);
      const int32_t *rs = seq_of, *rl = lens;
      if (last_subset) {  // compact the kept rows' queries (and residuals) to the front
        rows = static_cast<int64_t>(keep.size());
        for (int64_t i = 0; i < rows; ++i) {
          const int64_t r = keep[i];  // ascending, so r >= i: in-place moves are safe
          std::memmove(qg + i * q_size, qg + r * q_size, q_size * sizeof(float));
          std::memmove(hp + i * hidden, hp + r * hidden, hidden * sizeof(float));
          kept_seq.push_back(seq_of[r]);
          kept_lens.push_back(lens[r]);
        }
        rs = kept_seq.data(), rl = kept_lens.data();
      }
      attend_rows(qg, kc, vc, bt, block_tables.stride(0), rs, rl, rows, H, Hkv, Dh,
                  block_size, scale, attn.data_ptr<float>());
    });
    lap(1);
    if (rows == 0) break;  // no row to carry on (a prefill chunk that samples nothing)
    at::Tensor attn_r = first(attn), tmp_r = first(tmp), x_r = first(x), gu_r = first(gu),
               act_r = first(act);
    o[l]->run(attn_r, tmp_r);
    if (lora) lora->apply(l, 1, attn, tmp);
    lap_linear(1);
    add_rms_norm(hp, tp, post_norm[l].data_ptr<float>(), xp, rows, hidden, feps);
    lap(3);
    gate_up[l]->run(x_r, gu_r);
    if (lora) lora->apply(l, 2, x, gu);
    lap_linear(2);
    silu_mul(gu.data_ptr<float>(), act.data_ptr<float>(), rows, inter);
    lap(3);
    down[l]->run(act_r, tmp_r);
    if (lora) lora->apply(l, 3, act, tmp);
    lap_linear(3);
    if (l + 1 < num_layers()) {
      add_rms_norm(hp, tp, in_norm[l + 1].data_ptr<float>(), xp, B, hidden, feps);
    }
  }
  at::Tensor out = subset ? at::zeros({B, hidden}, opts) : at::empty({B, hidden}, opts);
  float* op = out.data_ptr<float>();
  if (num_layers() == 0) {
    rms_norm(hp, final_norm.data_ptr<float>(), op, B, hidden, feps);
  } else if (!subset) {
    add_rms_norm(hp, tp, final_norm.data_ptr<float>(), op, B, hidden, feps);
  } else if (rows > 0) {  // the kept rows, compact in h / tmp, to their places in out
    add_rms_norm(hp, tp, final_norm.data_ptr<float>(), xp, rows, hidden, feps);
    for (int64_t i = 0; i < rows; ++i)
      std::memcpy(op + keep[i] * hidden, xp + i * hidden, hidden * sizeof(float));
  }
  return out;
}

}  // namespace roseinfer
