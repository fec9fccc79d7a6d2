// LlamaStack step (see stack.h).
#include "stack.h"

#include <chrono>

#include "attention.h"
#include "rowops.h"

namespace roseinfer {

at::Tensor LlamaStack::run(at::Tensor h_in, at::Tensor positions, at::Tensor cos_sin,
                           std::vector<at::Tensor> kv_caches, at::Tensor block_tables,
                           at::Tensor token_seq, at::Tensor token_lens,
                           at::Tensor slot_mapping, int64_t block_size, const LoraStep* lora) {
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
  auto lap = [&](int which) {
    if (!profiling) return;
    auto now = clock::now();
    times[which] += std::chrono::duration<double>(now - mark).count();
    mark = now;
  };
  if (num_layers() > 0) rms_norm(hp, in_norm[0].data_ptr<float>(), xp, B, hidden, feps);
  for (int64_t l = 0; l < num_layers(); ++l) {
    lap(3);
    qkv[l]->run(x, qkv_buf);
    if (lora) lora->apply(l, 0, x, qkv_buf);
    lap(0);
    const at::Tensor& cache = kv_caches[l];
    float* qg = qbuf.data_ptr<float>();
    const int32_t* bt = block_tables.data_ptr<int32_t>();
    const int32_t* lens = token_lens.data_ptr<int32_t>();
    const int32_t* seq_of = token_seq.data_ptr<int32_t>();
    with_kv_halves(cache, [&](auto* kc, auto* vc) {
      rope_and_store(qp, B, H, Hkv, Dh, pp, sp, csp, qg, kc, vc);
      lap(2);
      attend_rows(qg, kc, vc, bt, block_tables.stride(0), seq_of, lens, B, H, Hkv, Dh,
                       block_size, scale, attn.data_ptr<float>());
    });
    lap(1);
    o[l]->run(attn, tmp);
    if (lora) lora->apply(l, 1, attn, tmp);
    lap(0);
    add_rms_norm(hp, tp, post_norm[l].data_ptr<float>(), xp, B, hidden, feps);
    lap(3);
    gate_up[l]->run(x, gu);
    if (lora) lora->apply(l, 2, x, gu);
    lap(0);
    silu_mul(gu.data_ptr<float>(), act.data_ptr<float>(), B, inter);
    lap(3);
    down[l]->run(act, tmp);
    if (lora) lora->apply(l, 3, act, tmp);
    lap(0);
    if (l + 1 < num_layers()) {
      add_rms_norm(hp, tp, in_norm[l + 1].data_ptr<float>(), xp, B, hidden, feps);
    }
  }
  at::Tensor out = at::empty({B, hidden}, opts);
  float* op = out.data_ptr<float>();
  if (num_layers() > 0) add_rms_norm(hp, tp, final_norm.data_ptr<float>(), op, B, hidden, feps);
  else rms_norm(hp, final_norm.data_ptr<float>(), op, B, hidden, feps);
  return out;
}

}  // namespace roseinfer
