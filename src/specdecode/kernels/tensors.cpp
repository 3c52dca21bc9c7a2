// The torch side of the kernels (ops.h): each function checks its tensors, allocates the
// output and calls its core (core.h) on the raw data; the cores run on torch's thread pool.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "core.h"
#include "dispatch.h"
#include "ops.h"

#include <cstdint>
#include <cstring>
#include <functional>
#include <tuple>
#include <vector>

namespace sd = specdecode;

void specdecode::parallel_for(int64_t begin, int64_t end, int64_t grain,
                              const std::function<void(int64_t, int64_t)>& body) {
  at::parallel_for(begin, end, grain, body);
}

int64_t specdecode::max_threads() { return at::get_num_threads(); }

namespace {

void check_bias(const c10::optional<at::Tensor>& bias, int64_t N) {
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kFloat &&
                                    bias->is_contiguous() && bias->numel() == N),
              "bias must be a contiguous fp32 [", N, "] tensor");
}

const float* bias_data(const c10::optional<at::Tensor>& bias) {
  return bias.has_value() ? bias->data_ptr<float>() : nullptr;
}

// Checks a packed weight [Np / 64, Kp / pack, 64, pack] against x [..., K], out_features N and
// bias; returns Kp.
int64_t check_packed(const at::Tensor& x, const at::Tensor& w, at::ScalarType wtype,
                     int64_t pack, int64_t N, const c10::optional<at::Tensor>& bias) {
  constexpr int64_t ROWS = sd::MATMUL_ROWS;
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "specdecode kernels run on the CPU");
  TORCH_CHECK(w.dim() == 4 && w.size(2) == ROWS && w.size(3) == pack &&
                  w.scalar_type() == wtype && w.is_contiguous(),
              "weight must be packed as a contiguous [Np/", ROWS, ", Kp/", pack, ", ", ROWS,
              ", ", pack, "] ", wtype, " tensor, got ", w.sizes(), " ", w.scalar_type());
  const int64_t Kp = w.size(1) * pack;
  TORCH_CHECK(x.size(-1) <= Kp && Kp - x.size(-1) < pack, "x has ", x.size(-1),
              " features, the packed weight ", Kp);
  TORCH_CHECK(N <= w.size(0) * ROWS && w.size(0) * ROWS - N < ROWS, "out_features ", N,
              " does not fit the packed weight's ", w.size(0) * ROWS, " rows");
  check_bias(bias, N);
  return Kp;
}

}  // namespace

// x [..., K] fp32 or bf16; w int8 packed [Np/64, Kp/4, 64, 4]; w_scale fp32 [Np];
// w_sum int32 [Np] (row sums of w); bias fp32 [N] or None. Returns [..., N] in x's dtype.
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& w_scale,
                       const at::Tensor& w_sum, const c10::optional<at::Tensor>& bias,
                       int64_t N) {
  const int64_t Kp = check_packed(x, w, at::kChar, sd::I8_PACK, N, bias);
  TORCH_CHECK(w_scale.scalar_type() == at::kFloat && w_sum.scalar_type() == at::kInt &&
                  w_scale.numel() == w.size(0) * sd::MATMUL_ROWS &&
                  w_sum.numel() == w.size(0) * sd::MATMUL_ROWS,
              "w_scale must be fp32 and w_sum int32, one per packed row");
  const int64_t K = x.size(-1);
  const at::Tensor rows = x.reshape({-1, K}).contiguous();  // [M, K]
  at::Tensor y = at::empty({rows.size(0), N}, rows.options());  // [M, N] in x's dtype
  fp32_or_bf16(rows.scalar_type(), "int8_linear", [&](auto type_tag) {
    using T = decltype(type_tag);
    sd::int8_matmul(data<const T>(rows), rows.size(0), K, w.data_ptr<int8_t>(), w.size(0), Kp,
                    w_scale.data_ptr<float>(), w_sum.data_ptr<int32_t>(), bias_data(bias), N,
                    data<T>(y));
  });
  return y.view(out_shape(x, N));
}

// x [..., K] bf16; w bf16 packed [Np/64, Kp/2, 64, 2]; bias fp32 [N] or None.
// Returns [..., N] bf16.
at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& w,
                       const c10::optional<at::Tensor>& bias, int64_t N) {
  const int64_t Kp = check_packed(x, w, at::kBFloat16, sd::BF16_PACK, N, bias);
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "x must be bf16, got ", x.scalar_type());
  const int64_t K = x.size(-1);
  at::Tensor rows = x.reshape({-1, K});  // [M, K]
  rows = K == Kp ? rows.contiguous() : at::constant_pad_nd(rows, {0, Kp - K});  // [M, Kp]
  at::Tensor y = at::empty({rows.size(0), N}, rows.options());  // [M, N] bf16
  sd::bf16_matmul(data<const sd::BFloat16>(rows), rows.size(0),
                  data<const sd::BFloat16>(w), w.size(0), Kp, bias_data(bias), N,
                  data<sd::BFloat16>(y));
  return y.view(out_shape(x, N));
}

// x [..., K] fp32 or bf16 in blocks of `block` (32 or 256; K % block == 0) -> (x8 int8 [M, K],
// dx fp32 [M, K / block], sx fp32 [M, K / block] (block 32; [M, 0] for 256), bsum16 int16
// [M, K / 16], bsum32 int16 [M, K / 32]) with M the number of rows of x; see gguf.cpp.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> gguf_quantize(
    const at::Tensor& x, int64_t block) {
  TORCH_CHECK(x.device().is_cpu(), "specdecode kernels run on the CPU");
  TORCH_CHECK(block == 32 || block == 256, "gguf_quantize blocks are 32 or 256, got ", block);
  const int64_t K = x.size(-1);
  TORCH_CHECK(K % block == 0, "gguf_quantize needs K % ", block, " == 0, got ", K);
  const at::Tensor rows = x.reshape({-1, K}).contiguous();  // [M, K]
  const int64_t M = rows.size(0);
  at::Tensor x8 = at::empty({M, K}, rows.options().dtype(at::kChar));
  const auto f32 = rows.options().dtype(at::kFloat), i16 = rows.options().dtype(at::kShort);
  at::Tensor dx = at::empty({M, K / block}, f32);
  at::Tensor sx = at::empty({M, block == 32 ? K / block : 0}, f32);
  at::Tensor bsum16 = at::empty({M, K / 16}, i16), bsum32 = at::empty({M, K / 32}, i16);
  fp32_or_bf16(rows.scalar_type(), "gguf_quantize", [&](auto type_tag) {
    using T = decltype(type_tag);
    sd::gguf_quantize(data<const T>(rows), M, K, block, x8.data_ptr<int8_t>(),
                      dx.data_ptr<float>(), sx.data_ptr<float>(), bsum16.data_ptr<int16_t>(),
                      bsum32.data_ptr<int16_t>());
  });
  return {x8, dx, sx, bsum16, bsum32};
}

// q uint8 [Np, K] (Np % 16 == 0; codes of BITS bits, K % (sub * subs) == 0) -> the codes of
// every tile's sub-blocks in the kernel's layout, uint8 [Np / 16, K / (sub * subs),
// subs * 16 * sub * BITS / 8] (the packed weight less its scale tables; gguf_blocks.pack).
at::Tensor gguf_pack_codes(const at::Tensor& q, int64_t bits, int64_t sub, int64_t subs) {
  TORCH_CHECK(q.scalar_type() == at::kByte && q.dim() == 2 && q.is_contiguous() &&
                  q.size(0) % sd::GGUF_ROWS == 0 && q.size(1) % (sub * subs) == 0 &&
                  sub % 8 == 0,
              "codes must be a contiguous uint8 [Np, K] tensor, Np % 16 == 0 and K % ",
              sub * subs, " == 0");
  TORCH_CHECK(bits == 4 || bits == 5 || bits == 6 || bits == 8, "no code layout for ", bits,
              " bits");
  const int64_t Np = q.size(0), K = q.size(1), nsb = K / (sub * subs);
  const int64_t sub_bytes = sd::GGUF_ROWS * sub * bits / 8;
  at::Tensor out = at::empty({Np / sd::GGUF_ROWS, nsb, subs * sub_bytes}, q.options());
  sd::gguf_pack_codes(q.data_ptr<uint8_t>(), Np, K, bits, sub, subs, out.data_ptr<uint8_t>());
  return out;
}

namespace {

// The block table of a pass: `table` [B, max_blocks] int64 (contiguous) over a pool of `blocks`
// blocks of `block_size` slots; every row's slots 0 .. starts[b] + T - 1 must lie in its blocks.
void check_table(const at::Tensor& table, int64_t B, int64_t T, int64_t blocks,
                 int64_t block_size, const std::vector<int64_t>& starts) {
  TORCH_CHECK(table.device().is_cpu() && table.scalar_type() == at::kLong && table.dim() == 2 &&
                  table.size(0) == B && table.is_contiguous(),
              "block_table must be a contiguous int64 CPU tensor [", B, ", max_blocks], got ",
              table.sizes(), " ", table.scalar_type());
  const int64_t max_blocks = table.size(1);
  const int64_t* entries = table.data_ptr<int64_t>();
  TORCH_CHECK(int64_t(starts.size()) == B, "one start per batch row");
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(starts[b] >= 0, "row ", b, ": start ", starts[b], " < 0");
    const int64_t used = (starts[b] + T + block_size - 1) / block_size;
    TORCH_CHECK(used <= max_blocks, "row ", b, ": slots ", starts[b], " + ", T, " need ", used,
                " blocks of ", block_size, ", the table holds ", max_blocks);
    for (int64_t j = 0; j < used; ++j) {
      const int64_t block = entries[b * max_blocks + j];
      TORCH_CHECK(block >= 0 && block < blocks, "row ", b, ": block ", block,
                  " is outside the pool's ", blocks);
    }
  }
}

}  // namespace

void write_kv(at::Tensor& pool, const at::Tensor& x, const at::Tensor& table,
              const std::vector<int64_t>& starts) {
  TORCH_CHECK(pool.dim() == 4 && x.dim() == 4 && pool.stride(3) == 1 && x.stride(3) == 1 &&
                  pool.scalar_type() == x.scalar_type() && pool.device().is_cpu() &&
                  x.device().is_cpu(),
              "write_kv needs a pool [blocks, Hkv, block_size, D] and x [B, T, Hkv, D] of one "
              "dtype with contiguous last dims; got ", pool.sizes(), " and ", x.sizes());
  const int64_t B = x.size(0), T = x.size(1), Hkv = x.size(2), D = x.size(3);
  const int64_t size = pool.size(2);
  TORCH_CHECK(pool.size(1) == Hkv && pool.size(3) == D, "the pool holds [", pool.size(1), ", ",
              pool.size(3), "] heads x D, x [", Hkv, ", ", D, "]");
  check_table(table, B, T, pool.size(0), size, starts);
  const int64_t max_blocks = table.size(1), bytes = D * int64_t(x.element_size());
  const int64_t* entries = table.data_ptr<int64_t>();
  char* dst = static_cast<char*>(pool.data_ptr());
  const char* src = static_cast<const char*>(x.data_ptr());
  const int64_t item = x.element_size();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      const int64_t slot = starts[b] + t;
      const int64_t block = entries[b * max_blocks + slot / size];
      for (int64_t h = 0; h < Hkv; ++h)
        std::memcpy(dst + (block * pool.stride(0) + h * pool.stride(1) +
                           slot % size * pool.stride(2)) * item,
                    src + (b * x.stride(0) + t * x.stride(1) + h * x.stride(2)) * item, bytes);
    }
}

// q [B, H, T, D]; starts [B]: query t of row b attends to slots 0 .. starts[b] + t. Without a
// block table, k and v are [B, Hkv, S, D] (any strides but a contiguous last dim, the same for
// both); with one (block_table [B, max_blocks] int64), pools of blocks [blocks, Hkv,
// block_size, D] where row b's slot s is slot s % block_size of block block_table[b][s /
// block_size] (a paged cache). Tree passes also give tree_starts [B] and tree_mask [B, T, M]
// bool: query t of row b then attends to slots 0 .. tree_starts[b] - 1 and to
// tree_starts[b] + r wherever tree_mask[b, t, r] (which must hold for its own slot
// starts[b] + t, and for no slot past the pass's; for no later slot at all under a window: a
// block drafter's entries see the later ones of their pass). window > 0: a query at position p
// reads no slot before p - window + 1 (a tree's own slots excepted: it must be shallower than
// the window). softcap > 0: the scores are soft-capped to softcap * tanh(score / softcap) (Gemma 2). Returns
// [B, H, T, D] in q's dtype.
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const std::vector<int64_t>& starts,
                            const std::vector<int64_t>& tree_starts,
                            const c10::optional<at::Tensor>& tree_mask,
                            const c10::optional<at::Tensor>& block_table,
                            int64_t window, double softcap) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "q, k, v must be 4-D");
  TORCH_CHECK(window >= 0, "window must be >= 0 (0: none), got ", window);
  TORCH_CHECK(softcap >= 0, "softcap must be >= 0 (0: none), got ", softcap);
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(),
              "specdecode kernels run on the CPU");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(),
              "q, k, v must share a dtype");
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3);
  const int64_t Hkv = k.size(1);
  TORCH_CHECK(v.sizes() == k.sizes() && v.strides() == k.strides() && k.size(3) == D &&
                  H % Hkv == 0 && k.stride(3) == 1,
              "k, v must be [rows or blocks, Hkv, slots, ", D, "] with one set of strides, a "
              "contiguous last dim and H % Hkv == 0; got q ", q.sizes(), ", k ", k.sizes(),
              " ", k.strides(), ", v ", v.sizes(), " ", v.strides());
  TORCH_CHECK(int64_t(starts.size()) == B, "one start per batch row");
  at::Tensor table;
  if (block_table.has_value()) {
    table = *block_table;
  } else {  // rectangular: row b is block b, of S slots
    TORCH_CHECK(k.size(0) == B, "k, v have ", k.size(0), " rows, q ", B);
    table = at::arange(B, at::kLong).view({B, 1});
  }
  check_table(table, B, T, k.size(0), k.size(2), starts);
  // Tree passes: per (row, query), the increasing offsets r past tree_starts[b] it may read.
  const bool tree = tree_mask.has_value();
  std::vector<int64_t> extra, extra_begin(B * T + 1, 0);
  if (tree) {
    const at::Tensor mask = tree_mask->to(at::kBool).contiguous();
    TORCH_CHECK(mask.dim() == 3 && mask.size(0) == B && mask.size(1) == T,
                "tree_mask must be [B, T, M] = [", B, ", ", T, ", M], got ", mask.sizes());
    TORCH_CHECK(int64_t(tree_starts.size()) == B, "one tree start per batch row");
    const int64_t M = mask.size(2);
    const bool* mp = mask.data_ptr<bool>();
    for (int64_t b = 0; b < B; ++b) {
      const int64_t offset = starts[b] - tree_starts[b];  // tree slots cached before the pass
      TORCH_CHECK(offset >= 0 && offset + T <= M, "row ", b, ": tree start ", tree_starts[b],
                  " must lie in 0 .. start ", starts[b], " and the mask must cover ",
                  offset + T, " slots, got ", M);
      for (int64_t t = 0; t < T; ++t) {
        const bool* row = mp + (b * T + t) * M;
        TORCH_CHECK(row[offset + t], "row ", b, ", query ", t, ": a query must see itself");
        for (int64_t r = 0; r < M; ++r) {
          if (!row[r]) continue;
          TORCH_CHECK(r < offset + T, "row ", b, ", query ", t, " may not see slot ",
                      tree_starts[b] + r, ", past the pass's last");
          TORCH_CHECK(window == 0 || r <= offset + t, "row ", b, ", query ", t,
                      " may not see the later slot ", tree_starts[b] + r, " under a window");
          extra.push_back(r);
        }
        extra_begin[b * T + t + 1] = int64_t(extra.size());
        TORCH_CHECK(window == 0 || extra_begin[b * T + t + 1] - extra_begin[b * T + t] <= window,
                    "row ", b, ", query ", t, ": a tree deeper than the window ", window);
      }
    }
  }
  const at::Tensor qc = q.contiguous();
  at::Tensor out = at::empty_like(qc);  // [B, H, T, D]
  const sd::AttentionShape shape{B,           H,           T,           D,
                                 Hkv,         k.stride(0), k.stride(1), k.stride(2),
                                 k.size(2),   table.size(1), table.data_ptr<int64_t>(),
                                 window,      float(softcap)};
  fp32_or_bf16(q.scalar_type(), "decode_attention", [&](auto type_tag) {
    using T_ = decltype(type_tag);
    sd::attention(data<const T_>(qc), data<const T_>(k), data<const T_>(v), shape, starts.data(),
                  tree ? tree_starts.data() : nullptr, extra.data(), extra_begin.data(),
                  data<T_>(out));
  });
  return out;
}

// RoPE in place on the first `heads` heads of every token: x [B, T, W] contiguous, W >= heads * D
// (a fused q/k/v projection's output: q and k heads first); cos, sin fp32 [B, T, D].
void rope_(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t heads) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 3 && x.is_contiguous(),
              "x must be a contiguous 3-D CPU tensor");
  const int64_t tokens = x.size(0) * x.size(1), D = cos.size(-1);
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                  cos.is_contiguous() && sin.is_contiguous() && cos.numel() == tokens * D &&
                  sin.numel() == tokens * D && D % 2 == 0 && heads * D <= x.size(2),
              "cos and sin must be contiguous fp32 [B, T, D] (D even) for x ", x.sizes(),
              " and ", heads, " heads");
  fp32_or_bf16(x.scalar_type(), "rope_", [&](auto type_tag) {
    using T = decltype(type_tag);
    sd::rope(data<T>(x), cos.data_ptr<float>(), sin.data_ptr<float>(), tokens, x.size(2), heads,
             D);
  });
}

// x [..., N] (fp32 or bf16, N >= 1) -> [...] int64: torch.argmax(x, -1) (the first largest
// value's index; a NaN counts as the largest).
at::Tensor argmax(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu(), "specdecode kernels run on the CPU");
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) > 0, "argmax needs x [..., N] with N >= 1, got ",
              x.sizes());
  const int64_t N = x.size(-1);
  const at::Tensor rows = x.reshape({-1, N}).contiguous();  // [M, N]
  at::Tensor out = at::empty(x.sizes().slice(0, x.dim() - 1), x.options().dtype(at::kLong));
  fp32_or_bf16(x.scalar_type(), "argmax", [&](auto type_tag) {
    using T = decltype(type_tag);
    sd::argmax(data<const T>(rows), rows.size(0), N, out.data_ptr<int64_t>());
  });
  return out;
}

// x [..., D] (fp32 or bf16) and weight [D] in x's dtype, or fp32 under bf16 x -> [..., D].
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.device().is_cpu(), "specdecode kernels run on the CPU");
  const int64_t D = x.size(-1);
  const bool fp32_weight = weight.scalar_type() == at::kFloat;
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == D &&
                  (weight.scalar_type() == x.scalar_type() || fp32_weight),
              "weight must be [", D, "] in x's dtype or fp32, got ", weight.sizes(), " ",
              weight.scalar_type());
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous();
  at::Tensor y = at::empty_like(xc);
  fp32_or_bf16(x.scalar_type(), "rms_norm", [&](auto type_tag) {
    using T = decltype(type_tag);
    if (fp32_weight)
      sd::rms_norm(data<const T>(xc), wc.data_ptr<float>(), xc.numel() / D, D, float(eps),
                   data<T>(y));
    else
      sd::rms_norm(data<const T>(xc), data<const T>(wc), xc.numel() / D, D, float(eps),
                   data<T>(y));
  });
  return y;
}
