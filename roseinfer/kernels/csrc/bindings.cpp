// Registers the kernels as torch ops / classes under the "roseinfer" namespace:
//   torch.classes.roseinfer.Linear(weight[N,K] f32, bias[N]|None, fp16: bool)
//       .set_bf16_weight(weight[N,K] bf16, min_rows): bf16 GEMM for inputs of >= min_rows
//       .set_int8_weight(q[N,K] int8, scales[N,K/32] f32): int8 x int16 (q8_gemm.h), every input
//       .set_q4_weight(q[N,K] int8 in [0,15], scales, mins [N,K/32] f32, act8): Q4_1 as it
//           is (act8: against int8 activations)
//       .set_gguf_weight(types: List[int], raws: List[uint8 [rows, row_bytes]], act8,
//           extra_copy): a GGUF's stored tensors as they are (gguf_gemm.h)
//       .forward_portable(x): the int8 / GGUF / fp32 formats' portable kernel (tests)
//   torch.ops.roseinfer.gguf_rows(raw, type, ids): dequantized rows of a stored tensor
//   torch.classes.roseinfer.LlamaStack(hidden, heads, kv_heads, head_dim, inter, eps, final_norm)
//       .forward(...), .forward_lora(..., LoraStep): the step with LoRA deltas (lora.h)
//       .set_profiling(on), .profile(): seconds in gemm, attention, kv_write + rotary,
//       row ops; .linear_profile(): the gemm seconds of qkv, o, gate_up, down
//   torch.classes.roseinfer.LoraAdapter(buffer f32 [n], plan int64 [P, 11], num_layers)
//   torch.classes.roseinfer.LoraStep(portable).add(start, end, adapter)
//       .apply(layer, linear, x [B, K], y [B, N]): y += the segments' deltas, in place
//   torch.ops.roseinfer.lora_fill(buffer, a_src, b_src, scalings, plan): an adapter's buffer
//   torch.ops.roseinfer.paged_attention(q, kv_cache, block_tables, token_seq, token_lens,
//                                       block_size, scale)   (prefill and decode rows)
//   torch.ops.roseinfer.paged_attention_portable(...): the same, an int8 cache's scalar
//       implementation (tests: the same bits as the AVX2 one)
//   torch.ops.roseinfer.rms_norm(x, w, eps), .silu_mul(gate_up),
//   torch.ops.roseinfer.row_argmax(logits [B, V]) -> (values [B], ids [B]): greedy picks
//   torch.ops.roseinfer.rope_and_cache_(qkv, positions, cos_sin, kv_cache, slot_mapping,
//                                       num_heads, num_kv_heads)   (in place)
// Layouts follow docs/CONTRACTS.md: kv_cache [2, slots, Hkv, Dh] float32; slot of
#include <torch/library.h>

#include "attention.h"
#include "linear.h"
#include "lora.h"
#include "row_argmax.h"
#include "rowops.h"
#include "stack.h"

TORCH_LIBRARY(roseinfer, m) {
  m.class_<roseinfer::Linear>("Linear")
      .def(torch::init<at::Tensor, std::optional<at::Tensor>, bool>())
      .def("forward", &roseinfer::Linear::forward)
      .def("set_bf16_weight", &roseinfer::Linear::set_bf16_weight)
      .def("set_int8_weight", &roseinfer::Linear::set_int8_weight)
      .def("set_q4_weight", &roseinfer::Linear::set_q4_weight)
      .def("set_gguf_weight", &roseinfer::Linear::set_gguf_weight)
      .def("forward_portable", &roseinfer::Linear::forward_portable)
      .def("has_greedy", &roseinfer::Linear::has_greedy)
      .def("greedy", &roseinfer::Linear::greedy)
      .def("in_features", [](const c10::intrusive_ptr<roseinfer::Linear>& self) {
        return self->in_features;
      })
      .def("out_features", [](const c10::intrusive_ptr<roseinfer::Linear>& self) {
        return self->out_features;
      });
  // LoRA classes first: LlamaStack.forward_lora takes a LoraStep.
  m.class_<roseinfer::LoraAdapter>("LoraAdapter")
      .def(torch::init<at::Tensor, at::Tensor, int64_t>());
  m.class_<roseinfer::LoraStep>("LoraStep")
      .def(torch::init<bool>())
      .def("add", &roseinfer::LoraStep::add)
      .def("apply", &roseinfer::LoraStep::apply_op);
  m.class_<roseinfer::LlamaStack>("LlamaStack")
      .def(torch::init<int64_t, int64_t, int64_t, int64_t, int64_t, double, at::Tensor>())
      .def("add_layer", &roseinfer::LlamaStack::add_layer)
      .def("num_layers", &roseinfer::LlamaStack::num_layers)
      .def("set_profiling", &roseinfer::LlamaStack::set_profiling)
      .def("profile", &roseinfer::LlamaStack::profile)
      .def("linear_profile", &roseinfer::LlamaStack::linear_profile)
      .def("forward", &roseinfer::LlamaStack::forward)
      .def("forward_lora", &roseinfer::LlamaStack::forward_lora);
  m.def(
      "paged_attention(Tensor q, Tensor kv_cache, Tensor block_tables, Tensor token_seq, "
      "Tensor token_lens, int block_size, float scale) -> Tensor");
  m.impl("paged_attention", c10::DispatchKey::CPU, &roseinfer::paged_attention);
  m.def(
      "paged_attention_portable(Tensor q, Tensor kv_cache, Tensor block_tables, "
      "Tensor token_seq, Tensor token_lens, int block_size, float scale) -> Tensor");
  m.impl("paged_attention_portable", c10::DispatchKey::CPU, &roseinfer::paged_attention_portable);
  m.def("lora_fill(Tensor(a!) buffer, Tensor[] a_src, Tensor[] b_src, float[] scalings, "
        "Tensor plan) -> ()");
  m.impl("lora_fill", c10::DispatchKey::CPU, &roseinfer::lora_fill);
  m.def("gguf_rows(Tensor raw, int type, Tensor ids) -> Tensor");
  m.impl("gguf_rows", c10::DispatchKey::CPU, &roseinfer::gguf_rows);
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.impl("rms_norm", c10::DispatchKey::CPU, &roseinfer::rms_norm_op);
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.impl("silu_mul", c10::DispatchKey::CPU, &roseinfer::silu_mul_op);
  m.def("row_argmax(Tensor logits) -> (Tensor, Tensor)");
  m.impl("row_argmax", c10::DispatchKey::CPU, &roseinfer::row_argmax_op);
  m.def(
      "rope_and_cache_(Tensor(a!) qkv, Tensor positions, Tensor cos_sin, Tensor(b!) kv_cache, "
      "Tensor slot_mapping, int num_heads, int num_kv_heads) -> ()");
  m.impl("rope_and_cache_", c10::DispatchKey::CPU, &roseinfer::rope_and_cache_op);
}
