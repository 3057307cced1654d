// The lean decoder's layer loop in one call (disco/engines/native_loop.py): the decoding and
// verification forwards of a Qwen2/Llama decoder whose four projections per layer run on the
// q4 x q8 kernel, with every session attending one query at a time (the CPU's reference plan).
//
// It calls the ATen ops the Python loop (disco/engines/lean_decoder.py, LeanDecoder.forward
// with the packed attention's reference plan) calls, in the same order on the same tensors, so
// it gives the same bits; what it removes is the interpreter's work between them (~60 ops per
// layer, ~4-5 ms of a 24-layer draft's token on a 2-core Zen 4). The engine checks the bits
// against the HF forward once per model before using it (packed_forward._lean_check).
//
// Arguments (see the Python caller for how they are built):
//   hidden [1, rows, hidden] (model dtype), cos/sin [1, rows, 1, head_dim];
//   weights: per layer 10 tensors: attention norm weight, wqkv weights, wqkv bias, wo weights,
//     wo bias, ffn norm weight, w13 weights, w13 bias, w2 weights, w2 bias (a bias of 0
//     elements: none); out_features: per layer the 4 projections' output widths;
//   keys/values: per layer and session (layer-major) the session's cache buffer
//     [1, kv_heads, capacity, head_dim]; spans: per session start row, end row, cached length.
// The new keys and values are written at each session's cached length; the caller records the
// new lengths. Returns the last hidden states [1, rows, hidden] before the final norm.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdint>
#include <vector>

at::Tensor q4q8_mm(const at::Tensor& x, const at::Tensor& weights, int64_t out_features);

namespace {

constexpr int64_t kTensorsPerLayer = 10;
constexpr int64_t kProjectionsPerLayer = 4;

// HF's Qwen2/Llama RMSNorm: float32 mean of squares, rsqrt, back to the input's dtype, times the weight.
at::Tensor rms_norm(const at::Tensor& weight, const at::Tensor& hidden, double eps) {
  auto states = hidden.to(at::kFloat);
  auto variance = states.pow(2).mean({-1}, /*keepdim=*/true);
  states = states * at::rsqrt(variance + eps);
  return weight * states.to(hidden.scalar_type());
}

// One q4 x q8 projection over every row and its bias: [1, rows, in] -> [1, rows, out].
at::Tensor project(const at::Tensor& states, const at::Tensor& weights, const at::Tensor& bias, int64_t out_features) {
  const int64_t rows = states.size(1), in_features = states.size(2);
  auto out = q4q8_mm(states.reshape({rows, in_features}).contiguous(), weights, out_features);
  if (bias.numel() > 0) out = out + bias;
  return out.view({1, rows, out_features});
}

at::Tensor rotate_half(const at::Tensor& states) {
  const int64_t half = states.size(-1) / 2;
  return at::cat({-states.slice(-1, half), states.slice(-1, 0, half)}, -1);
}

}  // namespace

at::Tensor decode_layers(const at::Tensor& hidden_in, const at::Tensor& cos, const at::Tensor& sin,
                         at::TensorList weights, at::IntArrayRef out_features, at::TensorList keys,
                         at::TensorList values, at::IntArrayRef spans, int64_t heads, int64_t kv_heads,
                         int64_t head_dim, double eps, double scaling, bool enable_gqa, at::ScalarType compute) {
  const int64_t layers = static_cast<int64_t>(weights.size()) / kTensorsPerLayer;
  const int64_t sessions = static_cast<int64_t>(spans.size()) / 3;
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == layers * kTensorsPerLayer && layers > 0,
              "decode_layers: weights must hold 10 tensors per layer");
  TORCH_CHECK(static_cast<int64_t>(out_features.size()) == layers * kProjectionsPerLayer,
              "decode_layers: out_features must hold 4 widths per layer");
  TORCH_CHECK(static_cast<int64_t>(spans.size()) == sessions * 3 && sessions > 0,
              "decode_layers: spans must hold (start, end, cached length) per session");
  TORCH_CHECK(static_cast<int64_t>(keys.size()) == layers * sessions && keys.size() == values.size(),
              "decode_layers: one key and one value buffer per layer and session");
  TORCH_CHECK(hidden_in.dim() == 3 && hidden_in.size(0) == 1, "decode_layers: hidden must be [1, rows, hidden]");
  const int64_t rows = hidden_in.size(1);
  for (int64_t s = 0; s < sessions; ++s) {
    const int64_t start = spans[3 * s], end = spans[3 * s + 1], cached = spans[3 * s + 2];
    TORCH_CHECK(0 <= start && start < end && end <= rows && (s == 0 ? start == 0 : start == spans[3 * s - 2]),
                "decode_layers: sessions must cover the rows in order, each with at least one row");
    for (int64_t layer = 0; layer < layers; ++layer)
      TORCH_CHECK(keys[layer * sessions + s].size(2) >= cached + end - start &&
                      values[layer * sessions + s].size(2) >= cached + end - start,
                  "decode_layers: a cache buffer is too short for its new rows");
  }
  TORCH_CHECK(spans[3 * sessions - 2] == rows, "decode_layers: sessions must cover every row");
  const at::ScalarType dtype = hidden_in.scalar_type();
  at::Tensor hidden = hidden_in;
  for (int64_t layer = 0; layer < layers; ++layer) {
    const at::Tensor* w = &weights[layer * kTensorsPerLayer];
    const int64_t* outs = &out_features[layer * kProjectionsPerLayer];
    auto qkv = project(rms_norm(w[0], hidden, eps), w[1], w[2], outs[0]).view({1, rows, heads + 2 * kv_heads, head_dim});
    auto query_key = qkv.slice(2, 0, heads + kv_heads);
    query_key = (query_key * cos) + (rotate_half(query_key) * sin);
    const auto query = query_key.slice(2, 0, heads).transpose(1, 2);  // [1, heads, rows, dim]
    const auto key = query_key.slice(2, heads).transpose(1, 2);  // [1, kv_heads, rows, dim]
    const auto value = qkv.slice(2, heads + kv_heads).transpose(1, 2);
    std::vector<at::Tensor> outputs;
    outputs.reserve(rows);
    for (int64_t s = 0; s < sessions; ++s) {
      const int64_t start = spans[3 * s], end = spans[3 * s + 1], cached = spans[3 * s + 2];
      const int64_t total = cached + end - start;
      const at::Tensor& key_buffer = keys[layer * sessions + s];
      const at::Tensor& value_buffer = values[layer * sessions + s];
      key_buffer.slice(2, cached, total).copy_(key.slice(2, start, end));
      value_buffer.slice(2, cached, total).copy_(value.slice(2, start, end));
      // The reference plan: query i over exactly the keys up to its own position, unmasked.
      const auto queries = query.slice(2, start, end).to(compute);
      const auto session_keys = key_buffer.slice(2, 0, total).to(compute);
      const auto session_values = value_buffer.slice(2, 0, total).to(compute);
      const int64_t first_key_end = total - (end - start) + 1;
      for (int64_t offset = 0; offset < end - start; ++offset) {
        const int64_t keys_end = first_key_end + offset;
        auto output = at::scaled_dot_product_attention(
            queries.slice(2, offset, offset + 1), session_keys.slice(2, 0, keys_end),
            session_values.slice(2, 0, keys_end), std::nullopt, 0.0, false, scaling, enable_gqa);
        outputs.push_back(output.transpose(1, 2).to(dtype));  // [1, 1, heads, dim]
      }
    }
    const auto attended = at::cat(outputs, 1);  // [1, rows, heads, dim]
    hidden = hidden + project(attended.reshape({1, rows, heads * head_dim}).contiguous(), w[3], w[4], outs[1]);
    const auto gate_up = project(rms_norm(w[5], hidden, eps), w[6], w[7], outs[2]);
    const int64_t width = gate_up.size(-1) / 2;
    hidden = hidden + project(at::silu(gate_up.slice(-1, 0, width)) * gate_up.slice(-1, width), w[8], w[9], outs[3]);
  }
  return hidden;
}

TORCH_LIBRARY_FRAGMENT(disco_q4q8, m) {
  m.def("decode_layers(Tensor hidden, Tensor cos, Tensor sin, Tensor[] weights, int[] out_features, "
        "Tensor[] keys, Tensor[] values, int[] spans, int heads, int kv_heads, int head_dim, float eps, "
        "float scaling, bool enable_gqa, ScalarType compute) -> Tensor");
}

TORCH_LIBRARY_IMPL(disco_q4q8, CPU, m) { m.impl("decode_layers", &decode_layers); }
