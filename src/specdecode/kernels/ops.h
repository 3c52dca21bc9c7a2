// What the kernels export to Python on torch tensors: the functions of tensors.cpp (each checks
// its tensors and calls its core, core.h) that ops.cpp binds, and the projection and
// decoder-layer objects of layer.cpp.
#pragma once

#include <ATen/ATen.h>

#include <tuple>
#include <vector>

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& w_scale,
                       const at::Tensor& w_sum, const c10::optional<at::Tensor>& bias, int64_t N);
at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& w,
                       const c10::optional<at::Tensor>& bias, int64_t N);
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> gguf_quantize(
    const at::Tensor& x, int64_t block);
at::Tensor gguf_pack_codes(const at::Tensor& q, int64_t bits, int64_t sub, int64_t subs);
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const std::vector<int64_t>& starts,
                            const std::vector<int64_t>& tree_starts,
                            const c10::optional<at::Tensor>& tree_mask,
                            const c10::optional<at::Tensor>& block_table,
                            int64_t window, double softcap);
// Store x [B, T, Hkv, D] (new token t of row b) at slot starts[b] + t of a pool of blocks
// [blocks, Hkv, block_size, D] through the block table [B, max_blocks] int64.
void write_kv(at::Tensor& pool, const at::Tensor& x, const at::Tensor& table,
              const std::vector<int64_t>& starts);
at::Tensor argmax(const at::Tensor& x);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
void rope_(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t heads);

// One row segment of a GGUF projection: its packed blocks (gguf_blocks.pack), its layout
// (bits, sub, subs, off, mins), its row count and its first output column.
using GgufSegment =
    std::tuple<at::Tensor, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t>;

// y = x @ W^T (+ b) for one packed projection in one of the native formats: x [..., K] ->
// y [..., N] in x's dtype. Holds the module's tensors (shared, not copied).
class Projection {
 public:
  static Projection int8(at::Tensor packed, at::Tensor scale, at::Tensor row_sum,
                         c10::optional<at::Tensor> bias, int64_t N);
  static Projection bf16(at::Tensor packed, c10::optional<at::Tensor> bias, int64_t N);
  static Projection gguf(std::vector<GgufSegment> segments, c10::optional<at::Tensor> bias,
                         int64_t N);
  at::Tensor operator()(const at::Tensor& x) const;

 private:
  at::Tensor gguf_call(const at::Tensor& x) const;

  enum class Format { int8, bf16, gguf };
  Format format_ = Format::bf16;
  at::Tensor packed_, scale_, row_sum_;  // int8 and bf16
  std::vector<GgufSegment> segments_;    // gguf
  std::vector<int64_t> blocks_;          // gguf: the activation block sizes the segments need
  int64_t K_ = 0;                        // gguf: the inputs
  c10::optional<at::Tensor> bias_;
  int64_t N_ = 0;
};

// One pre-norm decoder block (RMSNorm, fused q|k|v with optional q/k head norms and RoPE,
// per-query attention over the cache with an optional sliding window and soft-cap, o, RMSNorm,
// SwiGLU or GeGLU; Gemma's norms of each sublayer's output where given) for passes whose new
// tokens each attend by themselves (DECODE and TREE): the ops of model/transformer.py's Block
// in the same order, in one call.
class DecoderLayer {
 public:
  DecoderLayer(c10::optional<at::Tensor> input_norm, at::Tensor mlp_in_norm,
               c10::optional<at::Tensor> attn_out_norm, c10::optional<at::Tensor> mlp_out_norm,
               c10::optional<at::Tensor> q_norm, c10::optional<at::Tensor> k_norm, double eps,
               Projection qkv, Projection o, Projection gate_up, Projection down, int64_t heads,
               int64_t kv_heads, int64_t head_dim, bool gelu, double q_scale, int64_t window,
               double softcap);
  at::Tensor operator()(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                        const at::Tensor& k_cache, const at::Tensor& v_cache, int64_t layer,
                        const std::vector<int64_t>& starts,
                        const std::vector<int64_t>& tree_starts,
                        const c10::optional<at::Tensor>& tree_mask,
                        const at::Tensor& block_table) const;
  // The block over q|k|v's input already normed (`input` [B, T, W]: an EAGLE-3 head's
  // [norm(embedding), norm(feature)], W = 2 hidden) with its own residual `x` [B, T, hidden].
  at::Tensor normed(const at::Tensor& input, const at::Tensor& x, const at::Tensor& cos,
                    const at::Tensor& sin, const at::Tensor& k_cache, const at::Tensor& v_cache,
                    int64_t layer, const std::vector<int64_t>& starts,
                    const std::vector<int64_t>& tree_starts,
                    const c10::optional<at::Tensor>& tree_mask,
                    const at::Tensor& block_table) const;

 private:
  void norm_heads(at::Tensor& qkv, int64_t first, int64_t heads, const at::Tensor& weight) const;

  c10::optional<at::Tensor> input_norm_;                   // [hidden] (None: `normed` only)
  at::Tensor mlp_in_norm_;                                 // [hidden]
  c10::optional<at::Tensor> attn_out_norm_, mlp_out_norm_;  // [hidden] (Gemma)
  c10::optional<at::Tensor> q_norm_, k_norm_;              // [D] (Qwen3, Gemma 3)
  double eps_;
  Projection qkv_, o_, gate_up_, down_;
  int64_t heads_, kv_heads_, head_dim_;
  bool gelu_;       // GeGLU (tanh GELU) instead of SwiGLU
  double q_scale_;  // q's factor before attention (1: none)
  int64_t window_;  // sliding-window attention's slot count (0: none)
  double softcap_;  // the attention scores' soft-cap (0: none)
};
