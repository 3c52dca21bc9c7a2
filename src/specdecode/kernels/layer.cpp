// A projection in any native format as one object, and a whole decoder block in one call: a
// decode step of a small model spends more time in Python and dispatch between its ~12 ops per
// layer than in them (SmolLM2-135M: 30 layers). The block runs the same kernels and ATen ops,
// in the same order, as model/transformer.py's Block, so its output is bit for bit the same.

#include "ops.h"
#include "dispatch.h"

#include <algorithm>
#include <utility>

namespace sd = specdecode;

Projection Projection::int8(at::Tensor packed, at::Tensor scale, at::Tensor row_sum,
                            c10::optional<at::Tensor> bias, int64_t N) {
  Projection p;
  p.format_ = Format::int8;
  p.packed_ = std::move(packed), p.scale_ = std::move(scale), p.row_sum_ = std::move(row_sum);
  p.bias_ = std::move(bias), p.N_ = N;
  return p;
}

Projection Projection::bf16(at::Tensor packed, c10::optional<at::Tensor> bias, int64_t N) {
  Projection p;
  p.format_ = Format::bf16;
  p.packed_ = std::move(packed), p.bias_ = std::move(bias), p.N_ = N;
  return p;
}

Projection Projection::gguf(std::vector<GgufSegment> segments, c10::optional<at::Tensor> bias,
                            int64_t N) {
  TORCH_CHECK(!segments.empty(), "a GGUF projection needs at least one segment");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kFloat &&
                                    bias->is_contiguous() && bias->numel() == N),
              "bias must be a contiguous fp32 [", N, "] tensor");
  Projection p;
  p.format_ = Format::gguf;
  // every segment checked once here, so that a call runs the cores on raw pointers
  for (const auto& [packed, bits, sub, subs, off, mins, rows, offset] : segments) {
    const sd::GgufLayout layout{bits, sub, subs, off, mins};
    TORCH_CHECK(sd::gguf_supported(layout), "no GGUF kernel for the layout bits=", bits,
                " sub=", sub, " subs=", subs, " off=", off, " mins=", mins);
    const int64_t block = sub * subs, tiles = packed.size(0);
    TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == at::kByte &&
                    packed.dim() == 3 && packed.is_contiguous() &&
                    packed.size(2) == layout.superblock_bytes(),
                "packed GGUF weight must be a contiguous uint8 [Np/16, K/", block, ", ",
                layout.superblock_bytes(), "] CPU tensor, got ", packed.sizes());
    const int64_t K = packed.size(1) * block;
    TORCH_CHECK(p.K_ == 0 || p.K_ == K, "the segments have ", p.K_, " and ", K, " inputs");
    TORCH_CHECK(rows <= tiles * sd::GGUF_ROWS && tiles * sd::GGUF_ROWS - rows < sd::GGUF_ROWS,
                "a segment of ", rows, " rows does not fit its ", tiles * sd::GGUF_ROWS,
                " packed rows");
    TORCH_CHECK(offset >= 0 && offset + rows <= N, "a segment's columns ", offset, "..",
                offset + rows - 1, " lie outside the projection's ", N);
    p.K_ = K;
    if (std::find(p.blocks_.begin(), p.blocks_.end(), block) == p.blocks_.end())
      p.blocks_.push_back(block);
  }
  p.segments_ = std::move(segments), p.bias_ = std::move(bias), p.N_ = N;
  return p;
}

at::Tensor Projection::operator()(const at::Tensor& x) const {
  if (format_ == Format::int8) return int8_linear(x, packed_, scale_, row_sum_, bias_, N_);
  if (format_ == Format::bf16) return bf16_linear(x, packed_, bias_, N_);
  return gguf_call(x);
}

namespace {

// Where one block size's activations (sd::GgufActs) lie in a call's scratch bytes: dx, sx
// [M, K / B] fp32, bsum16 [M, K / 16], bsum32 [M, K / 32] int16, x8 [M, K] int8, each at a
// multiple of 64 bytes.
struct ActsPlan {
  int64_t dx, sx, bsum16, bsum32, x8, end;
  ActsPlan(int64_t start, int64_t M, int64_t K, int64_t block) {
    auto after = [](int64_t at, int64_t bytes) { return (at + bytes + 63) / 64 * 64; };
    dx = start;
    sx = after(dx, 4 * M * (K / block));
    bsum16 = after(sx, block == 32 ? 4 * M * (K / block) : 0);
    bsum32 = after(bsum16, 2 * M * (K / 16));
    x8 = after(bsum32, 2 * M * (K / 32));
    end = after(x8, M * K);
  }
};

}  // namespace

// gguf: the activations quantized once per block size into one scratch buffer, then every
// segment into its columns of y (the cores of gguf_quantize and gguf_linear, on the segments
// checked when the projection was built: ~5 fewer allocations and checks per block size).
at::Tensor Projection::gguf_call(const at::Tensor& x) const {
  TORCH_CHECK(x.device().is_cpu(), "specdecode kernels run on the CPU");
  TORCH_CHECK(x.size(-1) == K_, "x has ", x.size(-1), " features, the projection takes ", K_);
  const at::Tensor rows = x.reshape({-1, K_}).contiguous();  // [M, K]
  const int64_t M = rows.size(0);
  std::vector<ActsPlan> plans;
  for (const int64_t block : blocks_)
    plans.emplace_back(plans.empty() ? 0 : plans.back().end, M, K_, block);
  at::Tensor scratch = at::empty({plans.back().end}, rows.options().dtype(at::kByte));
  at::Tensor y = at::empty({M, N_}, rows.options());  // [M, N]
  fp32_or_bf16(rows.scalar_type(), "a GGUF projection", [&](auto type_tag) {
    using T = decltype(type_tag);
    auto* base = static_cast<uint8_t*>(scratch.data_ptr());
    std::vector<sd::GgufActs> acts;
    for (size_t i = 0; i < blocks_.size(); ++i) {
      const ActsPlan& plan = plans[i];
      auto* x8 = reinterpret_cast<int8_t*>(base + plan.x8);
      auto* dx = reinterpret_cast<float*>(base + plan.dx);
      auto* sx = reinterpret_cast<float*>(base + plan.sx);
      auto* bsum16 = reinterpret_cast<int16_t*>(base + plan.bsum16);
      auto* bsum32 = reinterpret_cast<int16_t*>(base + plan.bsum32);
      sd::gguf_quantize(data<const T>(rows), M, K_, blocks_[i], x8, dx, sx, bsum16, bsum32);
      acts.push_back({x8, dx, sx, bsum16, bsum32, K_});
    }
    const float* bias = bias_.has_value() ? bias_->data_ptr<float>() : nullptr;
    for (const auto& [packed, bits, sub, subs, off, mins, count, offset] : segments_) {
      const auto index = std::find(blocks_.begin(), blocks_.end(), sub * subs) - blocks_.begin();
      sd::GgufActs a = acts[index];
      if (mins != 2) a.sx = nullptr;  // read only by layouts with one min per block
      const auto* w = static_cast<const uint8_t*>(packed.const_data_ptr());
      sd::gguf_matmul(a, M, w, packed.size(0),
                      sd::GgufLayout{bits, sub, subs, off, mins},
                      bias == nullptr ? nullptr : bias + offset, count, data<T>(y) + offset, N_);
    }
  });
  return y.view(out_shape(x, N_));
}

DecoderLayer::DecoderLayer(c10::optional<at::Tensor> input_norm, at::Tensor mlp_in_norm,
                           c10::optional<at::Tensor> attn_out_norm,
                           c10::optional<at::Tensor> mlp_out_norm,
                           c10::optional<at::Tensor> q_norm, c10::optional<at::Tensor> k_norm,
                           double eps, Projection qkv, Projection o, Projection gate_up,
                           Projection down, int64_t heads, int64_t kv_heads, int64_t head_dim,
                           bool gelu, double q_scale, int64_t window, double softcap)
    : input_norm_(std::move(input_norm)),
      mlp_in_norm_(std::move(mlp_in_norm)),
      attn_out_norm_(std::move(attn_out_norm)),
      mlp_out_norm_(std::move(mlp_out_norm)),
      q_norm_(std::move(q_norm)),
      k_norm_(std::move(k_norm)),
      eps_(eps),
      qkv_(std::move(qkv)),
      o_(std::move(o)),
      gate_up_(std::move(gate_up)),
      down_(std::move(down)),
      heads_(heads),
      kv_heads_(kv_heads),
      head_dim_(head_dim),
      gelu_(gelu),
      q_scale_(q_scale),
      window_(window),
      softcap_(softcap) {
  TORCH_CHECK(q_norm_.has_value() == k_norm_.has_value(), "q and k head norms come together");
  TORCH_CHECK(window_ >= 0, "the window is a slot count (0: none), got ", window_);
  TORCH_CHECK(softcap_ >= 0, "the soft-cap must be >= 0 (0: none), got ", softcap_);
}

// The heads of x [B, T, W] in columns first .. first + heads * D, RMS-normed in place.
void DecoderLayer::norm_heads(at::Tensor& qkv, int64_t first, int64_t heads,
                              const at::Tensor& weight) const {
  const int64_t B = qkv.size(0), T = qkv.size(1), width = heads * head_dim_;
  at::Tensor part = qkv.narrow(-1, first, width);
  const at::Tensor normed = rms_norm(part.reshape({B, T, heads, head_dim_}).contiguous(), weight,
                                     eps_);  // [B, T, heads, D]
  part.copy_(normed.view({B, T, width}));
}

// x [B, T, hidden]; cos, sin fp32 [B, T, D]; k_cache, v_cache [L, blocks, Hkv, block_size, D]
// (a paged cache; block_table [B, max_blocks] int64 maps row b's slot s to slot s % block_size
// of block block_table[b][s / block_size]): the block's keys and values of new token t of row b
// go to slot starts[b] + t of `layer`, and its queries attend as decode_attention says
// (tree_starts and tree_mask: TREE passes; the layer's window and soft-cap). Returns the
// block's output [B, T, hidden]. `normed` is the same block from q|k|v's `input` (what the
// input norm gives here) and the residual x.
at::Tensor DecoderLayer::operator()(const at::Tensor& x, const at::Tensor& cos,
                                    const at::Tensor& sin, const at::Tensor& k_cache,
                                    const at::Tensor& v_cache, int64_t layer,
                                    const std::vector<int64_t>& starts,
                                    const std::vector<int64_t>& tree_starts,
                                    const c10::optional<at::Tensor>& tree_mask,
                                    const at::Tensor& block_table) const {
  TORCH_CHECK(input_norm_.has_value(), "this layer was built without an input norm: call normed");
  return normed(rms_norm(x, *input_norm_, eps_), x, cos, sin, k_cache, v_cache, layer, starts,
                tree_starts, tree_mask, block_table);
}

at::Tensor DecoderLayer::normed(const at::Tensor& input, const at::Tensor& x,
                                const at::Tensor& cos, const at::Tensor& sin,
                                const at::Tensor& k_cache, const at::Tensor& v_cache,
                                int64_t layer, const std::vector<int64_t>& starts,
                                const std::vector<int64_t>& tree_starts,
                                const c10::optional<at::Tensor>& tree_mask,
                                const at::Tensor& block_table) const {
  const int64_t B = x.size(0), T = x.size(1);
  TORCH_CHECK(int64_t(starts.size()) == B, "starts needs one entry per row of x");
  TORCH_CHECK(input.size(0) == B && input.size(1) == T,
              "the normed input and the residual need the same rows and tokens");
  at::Tensor qkv = qkv_(input);  // [B, T, (H + 2 Hkv) D]
  const int64_t q_width = heads_ * head_dim_, kv_width = kv_heads_ * head_dim_;
  if (q_norm_.has_value()) {  // Qwen3, Gemma 3: each q and k head normed before RoPE
    norm_heads(qkv, 0, heads_, *q_norm_);
    norm_heads(qkv, q_width, kv_heads_, *k_norm_);
  }
  rope_(qkv, cos, sin, heads_ + kv_heads_);  // q and k heads
  const auto parts = qkv.split_with_sizes({q_width, kv_width, kv_width}, -1);
  at::Tensor q = parts[0].view({B, T, heads_, head_dim_}).transpose(1, 2);  // [B, H, T, D]
  if (q_scale_ != 1.0) q = q * q_scale_;
  const at::Tensor k = parts[1].view({B, T, kv_heads_, head_dim_});  // [B, T, Hkv, D]
  const at::Tensor v = parts[2].view({B, T, kv_heads_, head_dim_});
  at::Tensor keys = k_cache.select(0, layer), values = v_cache.select(0, layer);
  write_kv(keys, k, block_table, starts);  // checks the table against the pool
  write_kv(values, v, block_table, starts);
  const at::Tensor out = decode_attention(q, keys, values, starts, tree_starts, tree_mask,
                                          block_table, window_, softcap_);  // [B, H, T, D]
  at::Tensor attn = o_(out.transpose(1, 2).reshape({B, T, -1}));  // [B, T, hidden]
  if (attn_out_norm_.has_value()) attn = rms_norm(attn, *attn_out_norm_, eps_);
  const at::Tensor h = x + attn;
  const auto gate_up = gate_up_(rms_norm(h, mlp_in_norm_, eps_)).chunk(2, -1);
  const at::Tensor act = gelu_ ? at::gelu(gate_up[0], "tanh") : at::silu(gate_up[0]);
  at::Tensor mlp = down_(act * gate_up[1]);  // [B, T, hidden]
  if (mlp_out_norm_.has_value()) mlp = rms_norm(mlp, *mlp_out_norm_, eps_);
  return h + mlp;
}
