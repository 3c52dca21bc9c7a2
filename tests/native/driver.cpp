// The kernels' native test driver: calls every core of core.h on random inputs and compares it
// with a scalar reference written from the documented arithmetic (this file), on whatever
// variant it was compiled for: x86 here, ARM64 under qemu-user (tests/native/run.py). Exact
// where the kernels promise the same bits on every variant (int8, GGUF, the bf16 vector sums
// outside AVX-512 BF16 / AMX, RMSNorm, RoPE, the fp16 and bf16 conversions), close where they
// do not (attention, AVX-512 BF16 sums); everywhere, a token's result must not depend on the
// other tokens of its pass (row-exactness). Prints one line per check; exit status 1 if any
// failed.

#include "../../src/specdecode/kernels/core.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <thread>
#include <vector>

#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace sd = specdecode;

// Whether parallel_for runs a range as one task (as torch's pool does with one thread), not
// in chunks of `grain`; a test may change it.
bool one_task = false;

// The cores run their parallel loops here in chunks of `grain` items (or one, see one_task),
// one after another (so a chunk's edges fall inside the data), each on a new thread, as the
// extension's pool threads run them: a thread that never asked for AMX's tile state (the
// permission is the process's) and never configured its tiles before.
void specdecode::parallel_for(int64_t begin, int64_t end, int64_t grain,
                              const std::function<void(int64_t, int64_t)>& body) {
  const int64_t step = one_task ? std::max<int64_t>(1, end - begin) : std::max<int64_t>(1, grain);
  for (int64_t lo = begin; lo < end; lo += step)
    std::thread([&body, lo, hi = std::min(end, lo + step)] { body(lo, hi); }).join();
}

// The pool size the cores see (attention splits its work by it); a test may change it.
int64_t pool_threads = 1;
int64_t specdecode::max_threads() { return pool_threads; }

namespace {

int failures = 0;

void report(bool ok, const std::string& what) {
  std::printf("%s %s\n", ok ? "ok  " : "FAIL", what.c_str());
  if (!ok) ++failures;
}

std::mt19937 rng(1234);

float uniform(float lo, float hi) { return std::uniform_real_distribution<float>(lo, hi)(rng); }
int32_t integer(int32_t lo, int32_t hi) { return std::uniform_int_distribution<int32_t>(lo, hi)(rng); }

std::vector<float> randn(int64_t n, float scale = 1.f) {
  std::normal_distribution<float> normal(0.f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = normal(rng);
  return v;
}

template <typename T>
std::vector<T> cast(const std::vector<float>& v) {
  return std::vector<T>(v.begin(), v.end());
}

bool same_bits(const float* a, const float* b, int64_t n) {
  return std::memcmp(a, b, sizeof(float) * n) == 0;
}
bool same_bits(const sd::BFloat16* a, const sd::BFloat16* b, int64_t n) {
  return std::memcmp(a, b, sizeof(sd::BFloat16) * n) == 0;
}

float max_rel_error(const std::vector<float>& got, const std::vector<double>& want) {
  double scale = 1e-30, worst = 0;
  for (double w : want) scale = std::max(scale, std::abs(w));
  for (size_t i = 0; i < got.size(); ++i) worst = std::max(worst, std::abs(got[i] - want[i]));
  return float(worst / scale);
}

std::string name(float) { return "fp32"; }
std::string name(sd::BFloat16) { return "bf16"; }

// ---------------------------------------------------------------- conversions

void check_conversions() {
  bool round_trip = true, ties = true, hardware = true;
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float f = sd::half_to_float(uint16_t(h));
    if (f == f && sd::float_to_half(f) != h) round_trip = false;  // every non-NaN half
    // halfway between two adjacent finite halves of one sign: to the even one; just off it: to
    // the nearer
    if ((h & 0x7FFF) < 0x7BFF) {
      const double a = sd::half_to_float(uint16_t(h)), b = sd::half_to_float(uint16_t(h + 1));
      const float mid = float((a + b) / 2);
      const uint16_t even = (h & 1) ? uint16_t(h + 1) : uint16_t(h);
      if (sd::float_to_half(mid) != even ||
          sd::float_to_half(std::nextafter(mid, float(a))) != h ||
          sd::float_to_half(std::nextafter(mid, float(b))) != h + 1)
        ties = false;
    }
  }
  for (int i = 0; i < 200000; ++i) {  // against the CPU's own conversion where it has one
    [[maybe_unused]] const float f = std::ldexp(uniform(-1.f, 1.f), integer(-30, 17));
#if defined(__F16C__)
    hardware &= sd::float_to_half(f) == _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
    const uint16_t h = uint16_t(integer(0, 0xFFFF));
    const float want = _cvtsh_ss(h), got = sd::half_to_float(h);
    hardware &= want != want ? got != got : std::memcmp(&want, &got, sizeof(float)) == 0;
#elif defined(__aarch64__)
    const __fp16 native = __fp16(f);
    uint16_t bits;
    std::memcpy(&bits, &native, sizeof(bits));
    hardware &= sd::float_to_half(f) == bits;
    const uint16_t h = uint16_t(integer(0, 0xFFFF));
    __fp16 hv;
    std::memcpy(&hv, &h, sizeof(h));
    const float want = float(hv), got = sd::half_to_float(h);
    hardware &= want != want ? got != got : std::memcmp(&want, &got, sizeof(float)) == 0;
#endif
  }
  report(round_trip, "fp16: every half converts to fp32 and back to itself");
  report(ties, "fp16: fp32 values round to the nearest half, ties to even");
  report(hardware, "fp16: conversions equal the CPU's own (where it has them)");

  bool bf16 = true;
  for (int i = 0; i < 200000; ++i) {
    const uint32_t top = uint32_t(integer(0, 0xFFFF)), low = uint32_t(integer(0, 0xFFFF));
    uint32_t u = top << 16 | (i % 3 == 0 ? 0x8000u : low);  // a third exactly halfway
    float f;
    std::memcpy(&f, &u, sizeof(f));
    uint32_t want;  // nearest even by the remainder, NaN -> 0x7FC0
    const uint32_t rest = u & 0xFFFF;
    want = (rest > 0x8000 || (rest == 0x8000 && (top & 1))) ? top + 1 : top;
    if (f != f) want = 0x7FC0;
    bf16 &= sd::BFloat16(f).bits == uint16_t(want);
  }
  report(bf16, "bf16: fp32 values round to nearest even, NaN to 0x7FC0");
}

// ---------------------------------------------------------------- int8

// W [N, K] int8 -> packed [blocks, Kp / 4, 64, 4] (zero-padded)
std::vector<int8_t> pack_int8(const std::vector<int8_t>& w, int64_t N, int64_t K, int64_t Kp) {
  const int64_t R = sd::MATMUL_ROWS, blocks = (N + R - 1) / R;
  std::vector<int8_t> packed(blocks * R * Kp, 0);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k)
      packed[((n / R * (Kp / 4) + k / 4) * R + n % R) * 4 + k % 4] = w[n * K + k];
  return packed;
}

template <typename T>
void check_int8(int64_t M, int64_t K, int64_t N, bool with_bias) {
  const int64_t Kp = (K + 3) / 4 * 4, R = sd::MATMUL_ROWS, blocks = (N + R - 1) / R;
  std::vector<int8_t> w(N * K);
  for (int8_t& v : w) v = int8_t(integer(-127, 127));
  std::vector<float> ws(blocks * R, 0.f);
  std::vector<int32_t> wsum(blocks * R, 0);
  for (int64_t n = 0; n < N; ++n) {
    ws[n] = uniform(0.001f, 0.02f);
    for (int64_t k = 0; k < K; ++k) wsum[n] += w[n * K + k];
  }
  const std::vector<float> bias = randn(N);
  const float* b = with_bias ? bias.data() : nullptr;
  const std::vector<T> x = cast<T>(randn(M * K, 2.f));
  const std::vector<int8_t> packed = pack_int8(w, N, K, Kp);
  std::vector<T> y(M * N);
  sd::int8_matmul(x.data(), M, K, packed.data(), blocks, Kp, ws.data(), wsum.data(), b, N,
                  y.data());
  // reference: x's row quantized by its absmax, integer dot, one fp32 epilogue
  std::vector<T> want(M * N);
  for (int64_t m = 0; m < M; ++m) {
    float absmax = 0.f;
    for (int64_t k = 0; k < K; ++k) absmax = std::max(absmax, std::abs(float(x[m * K + k])));
    absmax = std::max(absmax, 1e-8f);
    const float inv = 127.f / absmax, x_scale = absmax / 127.f;
    for (int64_t n = 0; n < N; ++n) {
      int64_t dot = 0;
      for (int64_t k = 0; k < K; ++k) {
        const float q = std::nearbyint(float(x[m * K + k]) * inv);
        dot += int64_t(std::min(127.f, std::max(-127.f, q))) * w[n * K + k];
      }
      float v = float(dot) * (x_scale * ws[n]);
      if (b != nullptr) v = v + b[n];
      want[m * N + n] = T(v);
    }
  }
  const std::string what = "int8_matmul " + name(T()) + " M=" + std::to_string(M) +
                           " K=" + std::to_string(K) + " N=" + std::to_string(N);
  report(same_bits(y.data(), want.data(), M * N), what + ": equals the reference");
}

// ---------------------------------------------------------------- bf16

void check_bf16(int64_t M, int64_t K, int64_t N, bool exact) {
  const int64_t Kp = (K + 1) / 2 * 2, R = sd::MATMUL_ROWS, blocks = (N + R - 1) / R;
  const std::vector<sd::BFloat16> w = cast<sd::BFloat16>(randn(N * K, 0.1f));
  std::vector<sd::BFloat16> packed(blocks * R * Kp, sd::BFloat16(0.f));
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k)
      packed[((n / R * (Kp / 2) + k / 2) * R + n % R) * 2 + k % 2] = w[n * K + k];
  std::vector<sd::BFloat16> x(M * Kp, sd::BFloat16(0.f));
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) x[m * Kp + k] = sd::BFloat16(randn(1)[0]);
  const std::vector<float> bias = randn(N);
  std::vector<sd::BFloat16> y(M * N);
  sd::bf16_matmul(x.data(), M, packed.data(), blocks, Kp, bias.data(), N, y.data());
  // reference: per pair of k in order, the odd product added first, each rounded to fp32
  std::vector<sd::BFloat16> want(M * N);
  std::vector<float> got(M * N);
  std::vector<double> close(M * N);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      float acc = 0.f;
      double exact_sum = 0;
      for (int64_t k = 0; k < Kp; k += 2)
        for (int64_t p = 1; p >= 0; --p) {
          const float a = x[m * Kp + k + p], wv = k + p < K ? float(w[n * K + k + p]) : 0.f;
          const float product = a * wv;
          acc = acc + product;
          exact_sum += double(a) * double(wv);
        }
      want[m * N + n] = sd::BFloat16(acc + bias[n]);
      close[m * N + n] = exact_sum + bias[n];
      got[m * N + n] = y[m * N + n];
    }
  const std::string what = "bf16_matmul M=" + std::to_string(M) + " K=" + std::to_string(K) +
                           " N=" + std::to_string(N);
  if (exact)
    report(same_bits(y.data(), want.data(), M * N), what + ": equals the reference");
  else
    report(max_rel_error(got, close) < 2e-2f, what + ": within bf16 rounding of the sum");
  // row-exact: each token alone gives its bits in the pass
  bool alone = true;
  for (int64_t m = 0; m < M; ++m) {
    std::vector<sd::BFloat16> one(N);
    sd::bf16_matmul(x.data() + m * Kp, 1, packed.data(), blocks, Kp, bias.data(), N, one.data());
    alone &= same_bits(one.data(), y.data() + m * N, N);
  }
  report(alone, what + ": each token alone gives the same bits");
}

// ---------------------------------------------------------------- GGUF

struct Format {
  const char* name;
  sd::GgufLayout layout;
};

const Format FORMATS[] = {
    {"Q4_0", {4, 32, 1, 8, 0}},  {"Q4_1", {4, 32, 1, 0, 2}},   {"Q5_0", {5, 32, 1, 16, 0}},
    {"Q5_1", {5, 32, 1, 0, 2}},  {"Q8_0", {8, 32, 1, 128, 0}}, {"Q4_K", {4, 32, 8, 0, 1}},
    {"Q5_K", {5, 32, 8, 0, 1}},  {"Q6_K", {6, 16, 16, 32, 0}},
};

// The activations of gguf_quantize, computed here: per block of B values absmax, codes
// round(x * 127 / absmax), dx (and sx) as gguf.cpp's header says, bsum16 / bsum32.
struct Acts {
  std::vector<int8_t> x8;
  std::vector<float> dx, sx;
  std::vector<int16_t> bsum16, bsum32;
};

template <typename T>
Acts quantize_reference(const std::vector<T>& x, int64_t M, int64_t K, int64_t B) {
  Acts a{std::vector<int8_t>(M * K), std::vector<float>(M * K / B),
         std::vector<float>(M * K / B), std::vector<int16_t>(M * K / 16),
         std::vector<int16_t>(M * K / 32)};
  for (int64_t m = 0; m < M; ++m)
    for (int64_t blk = 0; blk < K / B; ++blk) {
      const T* xb = x.data() + m * K + blk * B;
      float absmax = 0.f;
      for (int64_t i = 0; i < B; ++i) absmax = std::max(absmax, std::abs(float(xb[i])));
      const float inv = absmax > 0.f ? 127.f / absmax : 0.f;
      int32_t sum = 0;
      for (int64_t i = 0; i < B; ++i) {
        const int32_t q = int32_t(std::min(127.f, std::max(-127.f, std::nearbyint(float(xb[i]) * inv))));
        const int64_t k = blk * B + i;
        a.x8[m * K + k] = int8_t(q);
        a.bsum16[m * (K / 16) + k / 16] = int16_t(a.bsum16[m * (K / 16) + k / 16] + q);
        a.bsum32[m * (K / 32) + k / 32] = int16_t(a.bsum32[m * (K / 32) + k / 32] + q);
        sum += q;
      }
      auto fp16 = [](float v) { return sd::half_to_float(sd::float_to_half(v)); };
      if (B == 32) {
        a.dx[m * (K / B) + blk] = fp16(absmax / 127.f);
        a.sx[m * (K / B) + blk] = fp16(absmax / 127.f * float(sum));
      } else {
        a.dx[m * (K / B) + blk] = absmax > 0.f ? 1.f / inv : 0.f;
      }
    }
  return a;
}

// The core's activations of x [M, K] in blocks of B (gguf_quantize).
template <typename T>
Acts quantize_core(const std::vector<T>& x, int64_t M, int64_t K, int64_t B) {
  Acts a{std::vector<int8_t>(M * K), std::vector<float>(M * K / B), std::vector<float>(M * K / B),
         std::vector<int16_t>(M * K / 16), std::vector<int16_t>(M * K / 32)};
  sd::gguf_quantize(x.data(), M, K, B, a.x8.data(), a.dx.data(), a.sx.data(), a.bsum16.data(),
                    a.bsum32.data());
  return a;
}

// Whether two quantizations of `blocks` blocks of B values are the same: codes, sums, and the
// bits of dx (and of sx, B == 32).
bool quantized_alike(const Acts& a, const Acts& r, int64_t blocks, int64_t B) {
  return a.x8 == r.x8 && a.bsum16 == r.bsum16 && a.bsum32 == r.bsum32 &&
         same_bits(a.dx.data(), r.dx.data(), blocks) &&
         (B != 32 || same_bits(a.sx.data(), r.sx.data(), blocks));
}

// gguf_quantize on values the random rows never hold, against the reference: a block with a
// NaN (left out of the absmax), one with an infinity, one of zeros and negative zeros, one
// whose absmax is negative, and a plain one; both block sizes.
template <typename T>
void check_gguf_quantize_specials() {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  for (const int64_t B : {32, 256}) {
    const int64_t K = 5 * B;
    std::vector<float> v = randn(K);
    v[3] = nan;
    v[B + 7] = inf;
    for (int64_t i = 2 * B; i < 3 * B; ++i) v[i] = i % 2 ? -0.f : 0.f;
    v[3 * B + 1] = -9.f;
    const std::vector<T> x = cast<T>(v);
    report(quantized_alike(quantize_core(x, 1, K, B), quantize_reference(x, 1, K, B), K / B, B),
           std::string("gguf_quantize ") + name(T()) + " B=" + std::to_string(B) +
               ": NaN, infinity, zeros equal the reference");
  }
}

template <typename T>
void check_gguf(const Format& f, int64_t M, int64_t K, int64_t N) {
  const sd::GgufLayout& l = f.layout;
  const int64_t R = sd::GGUF_ROWS, Np = (N + R - 1) / R * R, B = l.superblock_values();
  const int64_t nsb = K / B, tiles = Np / R;
  // the weight's parts: codes q [Np, K], D and M fp16 [Np, nsb], sc and mn int8 [Np, K / S]
  std::vector<uint8_t> q(Np * K);
  for (uint8_t& v : q) v = uint8_t(integer(0, (1 << l.bits) - 1));
  std::vector<uint16_t> D(Np * nsb), Mn(Np * nsb);
  for (uint16_t& v : D) v = sd::float_to_half(uniform(0.0005f, 0.01f));
  for (uint16_t& v : Mn) v = sd::float_to_half(uniform(-0.01f, 0.01f));
  std::vector<int8_t> sc(Np * K / l.sub), mn(Np * K / l.sub);
  for (int8_t& v : sc) v = int8_t(l.mins == 1 ? integer(0, 63) : integer(-128, 127));
  for (int8_t& v : mn) v = int8_t(integer(0, 63));
  // packed: per tile and superblock, D [16], M [16], sc and mn [SUBS / 2][16][2], codes
  std::vector<uint8_t> codes(tiles * nsb * l.subs * l.sub_bytes());
  sd::gguf_pack_codes(q.data(), Np, K, l.bits, l.sub, l.subs, codes.data());
  const int64_t header = l.header_bytes(), sb_bytes = l.superblock_bytes();
  std::vector<uint8_t> w(tiles * nsb * sb_bytes);
  for (int64_t t = 0; t < tiles; ++t)
    for (int64_t s = 0; s < nsb; ++s) {
      uint8_t* h = w.data() + (t * nsb + s) * sb_bytes;
      for (int64_t r = 0; r < R; ++r) {
        const int64_t n = t * R + r;
        std::memcpy(h + 2 * r, &D[n * nsb + s], 2);
        if (l.mins) std::memcpy(h + 2 * R + 2 * r, &Mn[n * nsb + s], 2);
        for (int64_t j = 0; j < l.subs && l.subs > 1; ++j) {
          const int64_t at = (l.mins ? 4 : 2) * R + (j / 2) * 2 * R + 2 * r + j % 2;
          h[at] = uint8_t(sc[n * (K / l.sub) + s * l.subs + j]);
          if (l.mins == 1) h[at + l.subs * R] = uint8_t(mn[n * (K / l.sub) + s * l.subs + j]);
        }
      }
      std::memcpy(h + header, codes.data() + (t * nsb + s) * l.subs * l.sub_bytes(),
                  l.subs * l.sub_bytes());
    }
  const std::vector<T> x = cast<T>(randn(M * K));
  // the core's activations against the reference's
  const Acts a = quantize_core(x, M, K, B), r = quantize_reference(x, M, K, B);
  const std::string what = std::string("gguf ") + f.name + " " + name(T()) +
                           " M=" + std::to_string(M) + " K=" + std::to_string(K) +
                           " N=" + std::to_string(N);
  report(quantized_alike(a, r, M * K / B, B), what + ": gguf_quantize equals the reference");
  const std::vector<float> bias = randn(N);
  const int64_t ldy = N + 3;  // a wider output: y's other columns stay as they were
  std::vector<T> y(M * ldy, T(-7.f));
  const sd::GgufActs acts{a.x8.data(), a.dx.data(), a.sx.data(), a.bsum16.data(),
                          a.bsum32.data(), K};
  sd::gguf_matmul(acts, M, w.data(), tiles, l, bias.data(), N, y.data(), ldy);
  // reference: per superblock the integer sums, then the fp32 fused multiply-adds in order
  std::vector<T> want(M * ldy, T(-7.f));
  const std::vector<int16_t>& bs = l.sub == 16 ? r.bsum16 : r.bsum32;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      float acc = 0.f;
      for (int64_t s = 0; s < nsb; ++s) {
        int32_t main = 0, mins = 0;
        for (int64_t j = 0; j < l.subs; ++j) {
          const int64_t sub_index = s * l.subs + j, k0 = sub_index * l.sub;
          int32_t isum = 0;
          for (int64_t k = 0; k < l.sub; ++k) isum += q[n * K + k0 + k] * r.x8[m * K + k0 + k];
          const int32_t bsum = bs[m * (K / l.sub) + sub_index];
          const int32_t scale = l.subs > 1 ? sc[n * (K / l.sub) + sub_index] : 1;
          main += scale * (isum - int32_t(l.off) * bsum);
          if (l.mins == 1) mins += mn[n * (K / l.sub) + sub_index] * bsum;
        }
        const float dx = r.dx[m * nsb + s];
        acc = std::fma(float(main), sd::half_to_float(D[n * nsb + s]) * dx, acc);
        const float mv = sd::half_to_float(Mn[n * nsb + s]);
        if (l.mins == 1) acc = std::fma(-(mv * dx), float(mins), acc);
        if (l.mins == 2) acc = std::fma(-mv, r.sx[m * nsb + s], acc);
      }
      want[m * ldy + n] = T(acc + bias[n]);
    }
  report(same_bits(y.data(), want.data(), M * ldy), what + ": gguf_matmul equals the reference");
}

// ---------------------------------------------------------------- attention

// softcap > 0: scores soft-capped to softcap * tanh(score / softcap) (Gemma 2).
template <typename T>
void check_attention(int64_t B, int64_t H, int64_t Hkv, int64_t Tq, int64_t S, int64_t D,
                     bool tree, float softcap = 0.f) {
  std::vector<int64_t> rows(B);  // rectangular: row b is block b of S slots
  for (int64_t b = 0; b < B; ++b) rows[b] = b;
  const sd::AttentionShape shape{B,     H, Tq, D, Hkv, Hkv * S * D, S * D, D, S, 1, rows.data(),
                                 0, softcap};
  const std::vector<T> q = cast<T>(randn(B * H * Tq * D)), k = cast<T>(randn(B * Hkv * S * D)),
                       v = cast<T>(randn(B * Hkv * S * D));
  std::vector<int64_t> starts(B), tree_starts(B), extra, extra_begin(B * Tq + 1, 0);
  std::vector<std::vector<int64_t>> visible(B * Tq);  // the slots of each query, in order
  for (int64_t b = 0; b < B; ++b) {
    starts[b] = integer(0, int32_t(S - Tq));
    tree_starts[b] = tree ? integer(0, int32_t(starts[b])) : 0;
    for (int64_t t = 0; t < Tq; ++t) {
      std::vector<int64_t>& slots = visible[b * Tq + t];
      if (!tree) {
        for (int64_t s = 0; s <= starts[b] + t; ++s) slots.push_back(s);
      } else {  // the prefix, then a random subset of the tree slots up to its own
        for (int64_t s = 0; s < tree_starts[b]; ++s) slots.push_back(s);
        const int64_t own = starts[b] - tree_starts[b] + t;
        for (int64_t r = 0; r <= own; ++r)
          if (r == own || integer(0, 1)) {
            slots.push_back(tree_starts[b] + r);
            extra.push_back(r);
          }
      }
      extra_begin[b * Tq + t + 1] = int64_t(extra.size());
    }
  }
  std::vector<T> out(B * H * Tq * D);
  sd::attention(q.data(), k.data(), v.data(), shape, starts.data(),
                tree ? tree_starts.data() : nullptr, extra.data(), extra_begin.data(), out.data());
  // on a larger pool (the heads that share a KV head split into more, smaller blocks)
  std::vector<T> wide(out.size());
  pool_threads = 64;
  sd::attention(q.data(), k.data(), v.data(), shape, starts.data(),
                tree ? tree_starts.data() : nullptr, extra.data(), extra_begin.data(), wide.data());
  pool_threads = 1;
  std::vector<float> got(out.begin(), out.end());
  std::vector<double> want(out.size());
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t t = 0; t < Tq; ++t) {
        const int64_t kvh = h / (H / Hkv), row = (b * H + h) * Tq + t;
        const std::vector<int64_t>& slots = visible[b * Tq + t];
        std::vector<double> scores;
        for (int64_t s : slots) {
          double dot = 0;
          for (int64_t d = 0; d < D; ++d)
            dot += double(q[row * D + d]) * double(k[((b * Hkv + kvh) * S + s) * D + d]);
          const double score = dot / std::sqrt(double(D));
          scores.push_back(softcap > 0 ? softcap * std::tanh(score / softcap) : score);
        }
        const double top = *std::max_element(scores.begin(), scores.end());
        double total = 0;
        for (double& s : scores) total += (s = std::exp(s - top));
        for (int64_t d = 0; d < D; ++d) {
          double sum = 0;
          for (size_t i = 0; i < slots.size(); ++i)
            sum += scores[i] * double(v[((b * Hkv + kvh) * S + slots[i]) * D + d]);
          want[row * D + d] = sum / total;
        }
      }
  const std::string what = std::string("attention ") + (tree ? "tree " : "chain ") + name(T()) +
                           " B=" + std::to_string(B) + " H=" + std::to_string(H) + "/" +
                           std::to_string(Hkv) + " T=" + std::to_string(Tq) +
                           " D=" + std::to_string(D) +
                           (softcap > 0 ? " softcap=" + std::to_string(softcap) : "");
  const float tolerance = sizeof(T) == 2 ? 1e-2f : 1e-5f;
  report(max_rel_error(got, want) < tolerance, what + ": close to the fp64 reference");
  report(same_bits(wide.data(), out.data(), int64_t(out.size())),
         what + ": the same bits on a larger pool");
  if (tree) return;
  // chain: each query alone (a 1-token pass at its own start) gives the same bits
  bool alone = true;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < Tq; ++t) {
      const int64_t zero = 0;
      const sd::AttentionShape one_shape{1, H, 1, D, Hkv, 0, S * D, D, S, 1, &zero, 0, softcap};
      std::vector<T> q1(H * D), o1(H * D);
      for (int64_t h = 0; h < H; ++h)
        std::copy_n(q.data() + ((b * H + h) * Tq + t) * D, D, q1.data() + h * D);
      const int64_t start = starts[b] + t;
      sd::attention(q1.data(), k.data() + b * Hkv * S * D, v.data() + b * Hkv * S * D, one_shape,
                    &start, nullptr, nullptr, nullptr, o1.data());
      for (int64_t h = 0; h < H; ++h)
        alone &= same_bits(o1.data() + h * D, out.data() + ((b * H + h) * Tq + t) * D, D);
    }
  report(alone, what + ": each query alone gives the same bits");
}

// A paged cache: the same keys and values in blocks of 16 slots, scattered over a pool in a
// shuffled order, read through a block table, give the rectangular cache's bits.
template <typename T>
void check_paged_attention(int64_t B, int64_t H, int64_t Hkv, int64_t Tq, int64_t S, int64_t D,
                           bool tree) {
  constexpr int64_t BS = 16;
  const int64_t per_row = (S + BS - 1) / BS, blocks = B * per_row + 3;  // 3 unused blocks
  const std::vector<T> q = cast<T>(randn(B * H * Tq * D)), k = cast<T>(randn(B * Hkv * S * D)),
                       v = cast<T>(randn(B * Hkv * S * D));
  std::vector<int64_t> order(blocks);
  for (int64_t i = 0; i < blocks; ++i) order[i] = i;
  for (int64_t i = blocks - 1; i > 0; --i) std::swap(order[i], order[integer(0, int32_t(i))]);
  std::vector<int64_t> table(B * per_row);
  std::vector<T> kp(blocks * Hkv * BS * D), vp(blocks * Hkv * BS * D);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t j = 0; j < per_row; ++j) {
      const int64_t block = table[b * per_row + j] = order[b * per_row + j];
      for (int64_t h = 0; h < Hkv; ++h)
        for (int64_t o = 0; o < BS && j * BS + o < S; ++o)
          for (int64_t d = 0; d < D; ++d) {
            const int64_t from = ((b * Hkv + h) * S + j * BS + o) * D + d;
            const int64_t to = ((block * Hkv + h) * BS + o) * D + d;
            kp[to] = k[from], vp[to] = v[from];
          }
    }
  std::vector<int64_t> rows(B), starts(B), tree_starts(B), extra, extra_begin(B * Tq + 1, 0);
  for (int64_t b = 0; b < B; ++b) {
    rows[b] = b;
    starts[b] = integer(0, int32_t(S - Tq));
    tree_starts[b] = tree ? integer(0, int32_t(starts[b])) : 0;
    for (int64_t t = 0; t < Tq; ++t) {
      const int64_t own = starts[b] - tree_starts[b] + t;
      for (int64_t r = 0; tree && r <= own; ++r)
        if (r == own || integer(0, 1)) extra.push_back(r);
      extra_begin[b * Tq + t + 1] = int64_t(extra.size());
    }
  }
  const sd::AttentionShape flat{B, H, Tq, D, Hkv, Hkv * S * D, S * D, D, S, 1, rows.data()};
  const sd::AttentionShape paged{B,      H,  Tq,      D, Hkv, Hkv * BS * D, BS * D, D,
                                 BS, per_row, table.data()};
  std::vector<T> want(B * H * Tq * D), got(B * H * Tq * D);
  const int64_t* ts = tree ? tree_starts.data() : nullptr;
  sd::attention(q.data(), k.data(), v.data(), flat, starts.data(), ts, extra.data(),
                extra_begin.data(), want.data());
  sd::attention(q.data(), kp.data(), vp.data(), paged, starts.data(), ts, extra.data(),
                extra_begin.data(), got.data());
  report(same_bits(got.data(), want.data(), int64_t(got.size())),
         std::string("paged attention ") + (tree ? "tree " : "chain ") + name(T()) +
             " S=" + std::to_string(S) + " D=" + std::to_string(D) +
             ": the rectangular cache's bits");
}

// ---------------------------------------------------------------- RMSNorm, RoPE

template <typename T>
void check_pointwise(int64_t rows, int64_t D) {
  const std::vector<T> x = cast<T>(randn(rows * D, 3.f)), w = cast<T>(randn(D));
  std::vector<T> y(rows * D), want(rows * D);
  const float eps = 1e-6f;
  sd::rms_norm(x.data(), w.data(), rows, D, eps, y.data());
  for (int64_t r = 0; r < rows; ++r) {
    float squares = 0.f;  // in order, in fp32
    for (int64_t d = 0; d < D; ++d) squares += float(x[r * D + d]) * float(x[r * D + d]);
    const float inv = 1.f / std::sqrt(squares / float(D) + eps);
    for (int64_t d = 0; d < D; ++d)
      want[r * D + d] = T(float(w[d]) * float(T(float(x[r * D + d]) * inv)));
  }
  report(same_bits(y.data(), want.data(), rows * D),
         "rms_norm " + name(T()) + " D=" + std::to_string(D) + ": equals the reference");

  const int64_t heads = 3, W = heads * D + 5, half = D / 2;
  std::vector<T> z = cast<T>(randn(rows * W)), z_want = z;
  const std::vector<float> cos = randn(rows * D), sin = randn(rows * D);
  sd::rope(z.data(), cos.data(), sin.data(), rows, W, heads, D);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t h = 0; h < heads; ++h) {
      T* head = z_want.data() + r * W + h * D;
      const std::vector<float> old(head, head + D);
      for (int64_t d = 0; d < D; ++d) {
        const float rotated = d < half ? -old[d + half] : old[d - half];
        const float a = float(T(old[d] * float(T(cos[r * D + d]))));
        const float b = float(T(rotated * float(T(sin[r * D + d]))));
        head[d] = T(a + b);
      }
    }
  report(same_bits(z.data(), z_want.data(), rows * W),
         "rope " + name(T()) + " D=" + std::to_string(D) + ": equals the reference");
}

}  // namespace

// ---------------------------------------------------------------- argmax

// Rows of N values (random; a few distinct ones: ties; NaNs; all -inf; the largest last) against
// the first-largest scan, a NaN counting as the largest.
template <typename T>
void check_argmax(int64_t N) {
  const int64_t rows = 5;
  std::vector<T> x = cast<T>(randn(rows * N));
  for (int64_t i = 0; i < N; ++i) {
    x[N + i] = T(float(i % 3));                                  // row 1: ties
    x[3 * N + i] = T(-std::numeric_limits<float>::infinity());  // row 3: all -inf
  }
  x[2 * N + N / 2] = T(std::nanf("")), x[2 * N + N - 1] = T(std::nanf(""));  // row 2: NaNs
  x[4 * N + N - 1] = T(100.f);                                                // row 4: last
  std::vector<int64_t> got(rows), want(rows);
  sd::argmax(x.data(), rows, N, got.data());
  for (int64_t r = 0; r < rows; ++r) {
    int64_t best = 0;
    for (int64_t i = 0; i < N; ++i) {
      const float v = float(x[r * N + i]), top = float(x[r * N + best]);
      if (std::isnan(top)) break;
      if (std::isnan(v) || v > top) best = i;
    }
    want[r] = best;
  }
  report(got == want, "argmax " + name(T()) + " N=" + std::to_string(N) +
                          ": the first largest (a NaN the largest)");
}

int main() {
  const std::string isa = sd::isa();
  std::printf("kernels: %s\n", isa.c_str());
  check_conversions();
  // tiles of 1, 2, 3 and 4 tokens (5 = 3 + 2, 8 = 4 + 4); K = 600: the 256-bit paths' chunks
  // of 256 int8 / 128 bf16 values, the last one partial
  for (const int64_t M : {1, 3, 5, 8, 9})
    for (const auto& [K, N] :
         {std::pair<int64_t, int64_t>{64, 64}, {200, 80}, {35, 130}, {600, 70}}) {
      check_int8<float>(M, K, N, M != 3);
      check_int8<sd::BFloat16>(M, K, N, true);
    }
  // the AVX-512 BF16 and AMX sums pair products inside the instruction: close, not equal
  const bool bf16_exact = isa.find("bf16: avx512-bf16") == std::string::npos &&
                          isa.find("bf16: amx") == std::string::npos;
  for (const int64_t M : {1, 5, 17}) {
    check_bf16(M, 64, 64, bf16_exact);
    check_bf16(M, 94, 100, bf16_exact);
    check_bf16(M, 600, 70, bf16_exact);
  }
  check_gguf_quantize_specials<float>();
  check_gguf_quantize_specials<sd::BFloat16>();
  for (const Format& f : FORMATS)
    for (const int64_t M : {1, 2, 5, 9, 10, 11, 21}) {  // one group of tokens, 2 and 3
      check_gguf<float>(f, M, 512, 40);
      if (M == 5) check_gguf<sd::BFloat16>(f, M, 256, 16);
    }
  // one task over many blocks: several runs of REUSE_BYTES, every group of tokens over each
  one_task = true;
  for (const Format& f : FORMATS) check_gguf<float>(f, 21, 4096, 1000);
  check_int8<float>(9, 600, 1000, true);
  check_bf16(9, 600, 1000, bf16_exact);
  one_task = false;
  for (const bool tree : {false, true}) {
    check_attention<float>(2, 4, 2, 5, 40, 64, tree);
    check_attention<float>(1, 2, 1, 3, 70, 48, tree);
    check_attention<sd::BFloat16>(2, 4, 2, 5, 40, 64, tree);
    check_attention<sd::BFloat16>(1, 2, 2, 2, 33, 128, tree);
    check_attention<float>(2, 4, 2, 5, 40, 64, tree, 2.f);  // small: the cap bends most scores
    check_attention<sd::BFloat16>(1, 2, 2, 2, 33, 128, tree, 2.f);
    check_attention<float>(1, 2, 1, 3, 70, 48, tree, 2.f);
    // query heads per KV head: 6 (two blocks of 3), 7 (3 + 4), 3; head sizes of 5 and 10
    // 8-lane vectors (shorter last chunks), 20 (not a multiple of 8: AVX2's per-head path), 256
    check_attention<sd::BFloat16>(1, 12, 2, 4, 45, 128, tree);
    check_attention<float>(2, 7, 1, 3, 29, 40, tree);
    check_attention<sd::BFloat16>(1, 9, 3, 2, 50, 80, tree, 2.f);
    check_attention<float>(1, 6, 2, 3, 19, 20, tree);
    check_attention<sd::BFloat16>(1, 4, 1, 2, 23, 256, tree);
    // bf16 heads of 64 grouped 3 and 4 at a time (AVX-512), spans past whole blocks of slots
    check_attention<sd::BFloat16>(1, 9, 3, 3, 37, 64, tree);
    check_attention<sd::BFloat16>(1, 8, 2, 2, 70, 64, tree);
    check_paged_attention<float>(3, 4, 2, 5, 70, 64, tree);
    check_paged_attention<sd::BFloat16>(2, 4, 2, 3, 41, 128, tree);
    check_paged_attention<sd::BFloat16>(2, 2, 1, 2, 35, 48, tree);
  }
  check_pointwise<float>(7, 64);
  check_pointwise<sd::BFloat16>(7, 128);
  for (const int64_t N : {1, 7, 8, 9, 64, 1003}) {  // below, at and past one 8-lane vector
    check_argmax<float>(N);
    check_argmax<sd::BFloat16>(N);
  }
  const double peak = sd::int8_peak(100000);
  report(peak > 0 && std::isfinite(peak), "int8_peak: " + std::to_string(peak) + " G/s");
  std::printf("%s (%d checks failed)\n", failures ? "FAILED" : "passed", failures);
  return failures ? 1 : 0;
}
