// LlamaStack: all decoder layers + final norm of one step in one call, for any mix of
// decode tokens and prefill chunks: h [T, hidden] (embedded tokens) -> final-norm hidden
// [T, hidden].  Each layer writes every token's K/V into its cache slot first, then each
// token attends to its sequence's first token_lens[t] positions in the paged cache.  Every
// op is row-local (docs/CONTRACTS.md, batch invariance).
// out_rows (optional int64 [R], ascending): the rows whose hidden the caller reads.  The
// last layer then computes only its q/k/v and K/V writes for the other rows (their
// attention, o, MLP and final norm feed nothing: a prefill chunk's rows but the one
// sampled), and their output rows are zero; the rows it computes are bitwise the same.
#pragma once

#include <torch/custom_class.h>

#include <optional>
#include <vector>

#include "linear.h"
#include "lora.h"

namespace roseinfer {

struct LlamaStack : torch::CustomClassHolder {
  int64_t hidden, H, Hkv, Dh, inter;
  double eps;
  at::Tensor final_norm;
  std::vector<at::Tensor> in_norm, post_norm;
  std::vector<c10::intrusive_ptr<Linear>> qkv, o, gate_up, down;
  // Profile counters (seconds): gemm, attention, kv_write + rotary, other row ops; and
  // gemm split by linear: qkv, o, gate_up, down (each with its LoRA deltas).
  bool profiling = false;
  std::vector<double> times = std::vector<double>(4, 0.0);
  std::vector<double> linear_times = std::vector<double>(4, 0.0);

  LlamaStack(int64_t hidden_, int64_t heads, int64_t kv_heads, int64_t head_dim,
             int64_t inter_, double eps_, at::Tensor final_norm_)
      : hidden(hidden_), H(heads), Hkv(kv_heads), Dh(head_dim), inter(inter_), eps(eps_),
        final_norm(final_norm_.contiguous()) {}

  void add_layer(at::Tensor in_w, at::Tensor post_w, c10::intrusive_ptr<Linear> qkv_,
                 c10::intrusive_ptr<Linear> o_, c10::intrusive_ptr<Linear> gate_up_,
                 c10::intrusive_ptr<Linear> down_) {
    in_norm.push_back(in_w.contiguous());
    post_norm.push_back(post_w.contiguous());
    qkv.push_back(qkv_);
    o.push_back(o_);
    gate_up.push_back(gate_up_);
    down.push_back(down_);
  }

  int64_t num_layers() const { return (int64_t)qkv.size(); }

  void set_profiling(bool on) {
    profiling = on;
    std::fill(times.begin(), times.end(), 0.0);
    std::fill(linear_times.begin(), linear_times.end(), 0.0);
  }
  std::vector<double> profile() const { return times; }
  std::vector<double> linear_profile() const { return linear_times; }

  at::Tensor forward(at::Tensor h_in, at::Tensor positions, at::Tensor cos_sin,
                     std::vector<at::Tensor> kv_caches, at::Tensor block_tables,
                     at::Tensor token_seq, at::Tensor token_lens, at::Tensor slot_mapping,
                     int64_t block_size, std::optional<at::Tensor> out_rows) {
    return run(h_in, positions, cos_sin, kv_caches, block_tables, token_seq, token_lens,
               slot_mapping, block_size, nullptr, out_rows ? &*out_rows : nullptr);
  }
  // The same step with LoRA adapters: each segment's delta added after each linear
  // (lora.h); rows outside every segment are bitwise forward's.
  at::Tensor forward_lora(at::Tensor h_in, at::Tensor positions, at::Tensor cos_sin,
                          std::vector<at::Tensor> kv_caches, at::Tensor block_tables,
                          at::Tensor token_seq, at::Tensor token_lens,
                          at::Tensor slot_mapping, int64_t block_size,
                          c10::intrusive_ptr<LoraStep> lora) {
    return run(h_in, positions, cos_sin, kv_caches, block_tables, token_seq, token_lens,
               slot_mapping, block_size, lora.get());
  }
  at::Tensor run(at::Tensor h_in, at::Tensor positions, at::Tensor cos_sin,
                 std::vector<at::Tensor> kv_caches, at::Tensor block_tables,
                 at::Tensor token_seq, at::Tensor token_lens, at::Tensor slot_mapping,
                 int64_t block_size, const LoraStep* lora, const at::Tensor* out_rows = nullptr);
};

}  // namespace roseinfer
