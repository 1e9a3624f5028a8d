// workbench_cpu::decoder_stack — a Llama decoder's layers in one call, for a compiled step whose
// linears are our quantized kernel's and whose attention is our C++ op: per layer
//   x = x + o(attention(rope(qkv(norm1(x)))))        (the norm, RoPE and residual folded in)
//   x = x + down(silu(gate) * up)(norm2(x))
// through workbench_cpu::linear_at (cpu_quant_linear.cpp, with cpu_fused.h's folds) and
// workbench_cpu::attend_layer (cpu_attention.cpp), called as the per-layer graph calls them, in
// the same order, so the bits are the per-layer path's. What it saves is the host's work between
// the calls: a graph of 30 layers made 150 op calls from Python a step, this makes one.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>
#include <cstdint>

namespace {

using OptTensor = c10::optional<at::Tensor>;

at::Tensor linear_at(const at::Tensor& x, int64_t index, int64_t out_features, const OptTensor& norm, double eps,
                     bool glu, const OptTensor& residual) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("workbench_cpu::linear_at", "")
                       .typed<at::Tensor(const at::Tensor&, int64_t, int64_t, const OptTensor&, const OptTensor&, double,
                                         bool, const OptTensor&)>();
  return op.call(x, index, out_features, c10::nullopt, norm, eps, glu, residual);
}

using AttendLayer = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, at::Tensor&, at::Tensor&,
                               const OptTensor&, const OptTensor&, const at::Tensor&, const at::Tensor&,
                               const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t,
                               double, int64_t, const OptTensor&, int64_t, const OptTensor&, const OptTensor&);

at::Tensor decoder_stack(const at::Tensor& h, at::IntArrayRef weights, at::TensorList norms, double eps, int64_t heads,
                         int64_t kv_heads, int64_t head_dim, int64_t inter, at::IntArrayRef windows, double scale,
                         at::Tensor& k_bytes, at::Tensor& v_bytes, const OptTensor& k_scale, const OptTensor& v_scale,
                         const at::Tensor& slots, const at::Tensor& tables, const at::Tensor& row_seq,
                         const at::Tensor& prefix, const at::Tensor& extra_start, const at::Tensor& extra_keys,
                         int64_t isa, const at::Tensor& cos, const at::Tensor& sin) {
  static auto attend = c10::Dispatcher::singleton()
                           .findSchemaOrThrow("workbench_cpu::attend_layer", "")
                           .typed<AttendLayer>();
  const int64_t layers = static_cast<int64_t>(windows.size());
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == 4 * layers && static_cast<int64_t>(norms.size()) == 2 * layers,
              "decoder_stack: 4 weights (qkv, o, gate_up, down) and 2 norms a layer");
  TORCH_CHECK(h.dim() == 2, "decoder_stack: h [N, hidden]");
  const int64_t n = h.size(0), hidden = h.size(1), qs = heads * head_dim, kvs = kv_heads * head_dim;
  at::Tensor x = h;
  for (int64_t l = 0; l < layers; ++l) {
    const at::Tensor qkv = linear_at(x, weights[4 * l], qs + 2 * kvs, norms[2 * l], eps, false, c10::nullopt);
    const int64_t row = qkv.stride(0), at0 = qkv.storage_offset();     // q, k, v: views of each row's parts
    const at::Tensor q = qkv.as_strided({n, heads, head_dim}, {row, head_dim, 1}, at0);
    const at::Tensor k = qkv.as_strided({n, kv_heads, head_dim}, {row, head_dim, 1}, at0 + qs);
    const at::Tensor v = qkv.as_strided({n, kv_heads, head_dim}, {row, head_dim, 1}, at0 + qs + kvs);
    const at::Tensor out = attend.call(q, k, v, k_bytes, v_bytes, k_scale, v_scale, slots, tables, row_seq, prefix,
                                       extra_start, extra_keys, l, scale, windows[l], c10::nullopt, isa, cos, sin);
    x = linear_at(out.reshape({n, qs}), weights[4 * l + 1], hidden, c10::nullopt, 0.0, false, x);
    const at::Tensor gate_up = linear_at(x, weights[4 * l + 2], 2 * inter, norms[2 * l + 1], eps, false, c10::nullopt);
    x = linear_at(gate_up, weights[4 * l + 3], hidden, c10::nullopt, 0.0, true, x);
  }
  return x;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(workbench_cpu, m) {
  m.def("decoder_stack(Tensor h, int[] weights, Tensor[] norms, float eps, int heads, int kv_heads, int head_dim, "
        "int inter, int[] windows, float scale, Tensor(a!) k_bytes, Tensor(b!) v_bytes, Tensor(c!)? k_scale, "
        "Tensor(d!)? v_scale, Tensor slots, Tensor tables, Tensor row_seq, Tensor prefix, Tensor extra_start, "
        "Tensor extra_keys, int isa, Tensor cos, Tensor sin) -> Tensor");
}

TORCH_LIBRARY_IMPL(workbench_cpu, CPU, m) {
  m.impl("decoder_stack", &decoder_stack);
}
