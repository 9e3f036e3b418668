// The certified moments kernel in C++ (docs/algorithm.md, section 10: the native kernel).
//
// Same contract as moments_core/_kernel.py: for every slice, the exact mean and variance of
// the input floats rounded once to the target format.  The same three steps:
//
//   1. fast sums (section 4): per slice, with K the slice's first element and y = x - K,
//      S1 = sum y and S2 = sum y**2 in float64 (float64 pairs for float64 input), in an order
//      chosen for speed (lanes, four-row trees, per-thread partial sums, FMA for y*y + s):
//      the error bounds hold for any order and any binary tree, with or without FMA (a
//      contraction removes a rounding; each bound counts one per operation);
//   2. the rounding test (section 5): the bounds of moments_core/_kernel.py `approximate`,
//      `approximate_pairs`, `variance_of`, `certify`, term for term;
//   3. the exact path (section 7) for the slices the test leaves open (and NaN/Inf):
//      integer sums of the inputs' significands in a fixed-point big integer, the
//      numerator n S2 - S1**2 in integers, one rounding by integer division.
//
// Only the header and the standard library: the TensorFlow op (tf_stable_moments/_native)
// and the JAX FFI call (jax_kernel/_native) include it.  Compiled with -ffp-contract=off
// (TwoSum and the splitting need their roundings) and without -ffast-math.
#ifndef TF_STABLE_MOMENTS_NATIVE_MOMENTS_H_
#define TF_STABLE_MOMENTS_NATIVE_MOMENTS_H_

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <system_error>
#include <thread>
#include <type_traits>
#include <vector>

#if defined(__AVX__) || defined(__FMA__)
#include <immintrin.h>
#endif

namespace stable_moments {

// ------------------------------------------------------------------ formats (section 2)
struct Format {
  int precision;  // p: significant bits
  int emin;       // smallest normal number 2**emin: inputs and results below it flush to 0
  int emax;       // results >= 2**emax are inf
  int base() const { return emin - 52; }   // lowest bit of a normal input read as float64
  int top() const { return emax - 1 - emin; }  // largest exponent - base of a finite input
  bool wide() const { return precision <= 24; }  // float64 sums suffice (else pairs)
};

constexpr double kU = 1.0 / 9007199254740992.0;  // 2**-53
constexpr double kMargin = 1.0 + 1.0 / 1048576.0;  // 1 + 2**-20
const double kTiny = std::ldexp(1.0, -1000);  // pairs: what a flushed intermediate can lose

inline int64_t bits_of(double a) {
  int64_t b;
  std::memcpy(&b, &a, 8);
  return b;
}
inline double from_bits(int64_t b) {
  double a;
  std::memcpy(&a, &b, 8);
  return a;
}
inline double pow2(int k) { return from_bits(static_cast<int64_t>(k + 1023) << 52); }
inline int exponent_of(double a) {  // floor(log2 |a|) of a normal double; -1023 for zero
  return static_cast<int>((bits_of(a) >> 52) & 0x7FF) - 1023;
}
inline double gamma(double k) { return k * kU * (1.0 + 2.0 * k * kU); }

// ------------------------------------------------------------------ error-free steps
inline void two_sum(double a, double b, double& s, double& e) {
  s = a + b;
  double bb = s - a;
  e = (a - (s - bb)) + (b - bb);
}
inline void fast_two_sum(double a, double b, double& s, double& e) {
  s = a + b;
  e = b - (s - a);
}
inline void split(double a, double& hi, double& lo) {  // hi: 26 significant bits, by integers
  hi = from_bits((bits_of(a) + (int64_t(1) << 26)) & ~((int64_t(1) << 27) - 1));
  lo = a - hi;
}
inline void two_prod(double a, double b, double& p, double& e) {
  double ah, al, bh, bl, e1, e2;
  split(a, ah, al);
  split(b, bh, bl);
  two_sum(ah * bh, ah * bl, p, e1);
  two_sum(p, al * bh, p, e2);
  e = (e1 + e2) + al * bl;
}
struct Pair {
  double h = 0.0, l = 0.0;
};
inline Pair df_add(Pair a, Pair b) {
  double s, e;
  two_sum(a.h, b.h, s, e);
  Pair r;
  fast_two_sum(s, e + (a.l + b.l), r.h, r.l);
  return r;
}
// Pair product within 26 u**2 |a b| (17 u**2 when a.l or b.l is 0): moments_core/_kernel.py
// `df_mul` counts the roundings.
inline Pair df_mul(Pair a, Pair b) {
  double p, e, c1, c2, t;
  two_prod(a.h, b.h, p, e);
  two_prod(a.h, b.l, c1, t);
  two_prod(a.l, b.h, c2, t);
  Pair r;
  fast_two_sum(p, e + (c1 + c2), r.h, r.l);
  return r;
}
inline void square(double dh, double dl, double& qh, double& ql) {
  double ah, al, ch, cl, q1;
  split(dh, ah, al);
  split(dl, ch, cl);
  double a2 = ah + ah;
  two_sum(ah * ah, a2 * al, qh, q1);
  ql = q1 + ((al * al + a2 * ch) + (a2 * cl + (al + al) * ch));
}

// 1/n as a float64 pair (h, l): h = fl(1/n), l = fl(1/n - h), exactly as
// moments_core/_kernel.py `reciprocal_pair` rounds them on the host (n < 2**46).  With
// h = M 2**E, 1/n - h = (2**-E - n M) 2**E / n; the integer r = 2**-E - n M is exact in
// 128 bits and |r| < n < 2**53, so l = fl(r 2**E / n) is one IEEE division.
inline Pair reciprocal_pair(int64_t n) {
  Pair r;
  double nd = static_cast<double>(n);
  r.h = 1.0 / nd;
  int e;
  double m = std::frexp(r.h, &e);  // h = m 2**e, 0.5 <= m < 1
  int64_t M = static_cast<int64_t>(std::ldexp(m, 53));
  int E = e - 53;  // h = M 2**E, -E <= 99
  __int128 rem = ((__int128)1 << (-E)) - (__int128)n * M;
  r.l = std::ldexp(static_cast<double>(static_cast<int64_t>(rem)), E) / nd;
  return r;
}

// ------------------------------------------------------------------ rounding test
struct Nearest {
  double c, lo, hi;
};
inline Nearest nearest(double a, const Format& f) {  // a > 0 normal
  int p = f.precision;
  int e = exponent_of(a);
  double unit = pow2(e - (p - 1));
  double k = std::nearbyint(a * pow2((p - 1) - e));  // ties to even (default mode)
  double c = k * unit;
  bool top = k == pow2(p);
  bool power = top || k == pow2(p - 1);
  double ulp = top ? unit + unit : unit;
  return {c, c - (power ? 0.25 * ulp : 0.5 * ulp), c + 0.5 * ulp};
}

// The correctly rounded value of every number within err of v = (h, l), if one exists.
inline bool certify(Pair v, double err, const Format& f, double& out) {
  double h = v.h, l = v.l;
  double tiny = pow2(f.emin);
  bool negative = h < 0;
  double a = std::fabs(h);
  double low = negative ? -l : l;
  bool zero;
  bool ok;
  double value, gap;
  if (f.precision == 53) {
    zero = a == 0.0 && low == 0.0 && err == 0.0;
    int e = exponent_of(a);
    ok = e >= -969 && e <= 1023;
    double unit = pow2(ok ? e - 52 : 0);
    bool power = (bits_of(a) & ((int64_t(1) << 52) - 1)) == 0;
    double below = power ? 0.25 * unit : 0.5 * unit;
    gap = low >= 0 ? 0.5 * unit - low : below + low;
    value = a;
  } else {
    zero = a < 0.25 * tiny && std::fabs(low) < 0.25 * tiny && err < 0.25 * tiny;
    ok = a >= 0.25 * tiny && a < pow2(1000);
    double safe = ok ? a : 1.0;
    Nearest nr = nearest(safe, f);
    gap = std::min(nr.hi - safe, safe - nr.lo);
    value = nr.c;
    if (value >= pow2(f.emax)) value = std::numeric_limits<double>::infinity();
    if (value < tiny) value = 0.0;
  }
  bool decided = (ok && err + err < gap) || zero;
  if (zero) value = 0.0;
  if (negative && value != 0.0) value = -value;
  out = value;
  return decided;
}

// ------------------------------------------------------------------ fast sums (section 4)
// Per slice: s1 = sum y, s2 = sum y**2 (wide formats: l parts unused).
struct Sums {
  double h1 = 0.0, l1 = 0.0, h2 = 0.0, l2 = 0.0;
};

template <typename T>
inline double flushed(T v, double tiny) {
  double d = static_cast<double>(v);
  return std::fabs(d) < tiny ? 0.0 : d;
}

typedef double v4d __attribute__((vector_size(32)));
typedef float v4f __attribute__((vector_size(16)));
typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef int64_t v4i __attribute__((vector_size(32)));

inline v4d splat4(double a) { return (v4d){a, a, a, a}; }
inline v4d load4d(const double* p) {
  v4d d;
  std::memcpy(&d, p, sizeof(d));
  return d;
}
inline void store4d(double* p, v4d d) { std::memcpy(p, &d, sizeof(d)); }
inline v4d flush4(v4d d, v4d tiny) {
  v4d a = (v4d)((v4i)d & (v4i){INT64_MAX, INT64_MAX, INT64_MAX, INT64_MAX});
  return a < tiny ? (v4d){0.0, 0.0, 0.0, 0.0} : d;
}
// y * y + acc: one rounding where the machine has FMA (a contraction removes a rounding:
// the bounds of section 4 count one per operation), else two.
inline v4d square_add(v4d y, v4d acc) {
#ifdef __FMA__
  return (v4d)_mm256_fmadd_pd((__m256d)y, (__m256d)y, (__m256d)acc);
#else
  return y * y + acc;
#endif
}

// Eight consecutive inputs, flushed (|v| < tiny -> 0) and converted to float64 (exact), as
// two vectors of four.  float32 data are flushed as float32 (8 lanes): tiny = 2**emin is a
// float32 number for every format read as float32, so the comparison is the same.
template <typename T>
struct Load8;
template <>
struct Load8<float> {
  v8f tiny;
  explicit Load8(double t) {
    float f = static_cast<float>(t);
    tiny = (v8f){f, f, f, f, f, f, f, f};
  }
  void operator()(const float* p, v4d& lo, v4d& hi) const {
    v8f v;
    std::memcpy(&v, p, sizeof(v));
    v8f a = (v8f)((v8i)v & (v8i){INT32_MAX, INT32_MAX, INT32_MAX, INT32_MAX, INT32_MAX,
                                   INT32_MAX, INT32_MAX, INT32_MAX});
    v = a < tiny ? (v8f){} : v;
#ifdef __AVX__
    lo = (v4d)_mm256_cvtps_pd(_mm256_castps256_ps128((__m256)v));
    hi = (v4d)_mm256_cvtps_pd(_mm256_extractf128_ps((__m256)v, 1));
#else
    lo = __builtin_convertvector(__builtin_shufflevector(v, v, 0, 1, 2, 3), v4d);
    hi = __builtin_convertvector(__builtin_shufflevector(v, v, 4, 5, 6, 7), v4d);
#endif
  }
};
template <>
struct Load8<double> {
  v4d tiny;
  explicit Load8(double t) : tiny(splat4(t)) {}
  void operator()(const double* p, v4d& lo, v4d& hi) const {
    lo = flush4(load4d(p), tiny);
    hi = flush4(load4d(p + 4), tiny);
  }
};

// One contiguous slice p[0, m) (rows layout, float64 sums): s1 += sum y, s2 += sum y**2,
// y = p[k] - K, in 4 x 4 lanes (16 consecutive inputs per step, 8 independent chains).
template <typename T>
void row_sums(const T* p, int64_t m, double K, double tiny, double& s1, double& s2) {
  const Load8<T> load(tiny);
  const v4d kv = splat4(K);
  v4d a0 = {}, a1 = {}, a2 = {}, a3 = {}, b0 = {}, b1 = {}, b2 = {}, b3 = {};
  int64_t k = 0;
  for (; k + 16 <= m; k += 16) {
    v4d y0, y1, y2, y3;
    load(p + k, y0, y1);
    load(p + k + 8, y2, y3);
    y0 -= kv;
    y1 -= kv;
    y2 -= kv;
    y3 -= kv;
    a0 += y0;
    a1 += y1;
    a2 += y2;
    a3 += y3;
    b0 = square_add(y0, b0);
    b1 = square_add(y1, b1);
    b2 = square_add(y2, b2);
    b3 = square_add(y3, b3);
  }
  v4d a = (a0 + a1) + (a2 + a3), b = (b0 + b1) + (b2 + b3);
  double t1 = (a[0] + a[1]) + (a[2] + a[3]), t2 = (b[0] + b[1]) + (b[2] + b[3]);
  for (; k < m; ++k) {
    double y = flushed(p[k], tiny) - K;
    t1 += y;
    t2 += y * y;
  }
  s1 += t1;
  s2 += t2;
}

// Rows [k0, k1) of a block [n, w] (columns layout, float64 sums, w >= 1): s1[i] += sum y,
// s2[i] += sum y**2 over the column i, y = x[k, i] - K[i].  Four rows at a time: their
// terms are added in a small tree, then into the column's sum (the memory is read in
// order, the sums stay in cache and are loaded and stored once per four rows).
template <typename T>
void column_sums(const T* base, int64_t w, int64_t k0, int64_t k1, const double* K,
                 double tiny, double* s1, double* s2) {
  const Load8<T> load(tiny);
  int64_t k = k0;
  for (; k + 4 <= k1; k += 4) {
    const T* r0 = base + k * w;
    const T* r1 = r0 + w;
    const T* r2 = r1 + w;
    const T* r3 = r2 + w;
    int64_t i = 0;
    for (; i + 8 <= w; i += 8) {
      for (int h = 0; h < 2; ++h) {  // h: the low and high four of eight columns
        v4d y[4][2];
        load(r0 + i, y[0][0], y[0][1]);
        load(r1 + i, y[1][0], y[1][1]);
        load(r2 + i, y[2][0], y[2][1]);
        load(r3 + i, y[3][0], y[3][1]);
        const v4d kv = load4d(K + i + 4 * h);
        v4d u0 = y[0][h] - kv, u1 = y[1][h] - kv, u2 = y[2][h] - kv, u3 = y[3][h] - kv;
        v4d t1 = (u0 + u1) + (u2 + u3);
        v4d t2 = square_add(u1, u0 * u0) + square_add(u3, u2 * u2);
        store4d(s1 + i + 4 * h, load4d(s1 + i + 4 * h) + t1);
        store4d(s2 + i + 4 * h, load4d(s2 + i + 4 * h) + t2);
      }
    }
    for (; i < w; ++i) {
      double u0 = flushed(r0[i], tiny) - K[i], u1 = flushed(r1[i], tiny) - K[i];
      double u2 = flushed(r2[i], tiny) - K[i], u3 = flushed(r3[i], tiny) - K[i];
      s1[i] += (u0 + u1) + (u2 + u3);
      s2[i] += (u0 * u0 + u1 * u1) + (u2 * u2 + u3 * u3);
    }
  }
  for (; k < k1; ++k) {
    const T* __restrict row = base + k * w;
    for (int64_t i = 0; i < w; ++i) {
      double y = flushed(row[i], tiny) - K[i];
      s1[i] += y;
      s2[i] += y * y;
    }
  }
}

// float64 pairs, rows [k0, k1) of a block [n, w]: y = x - K exactly as (yh, yl);
// compensated sums of y and of y**2 (two_sum on the high parts, the errors and low parts
// added into l1, l2).
template <typename T>
void column_pair_sums(const T* base, int64_t w, int64_t k0, int64_t k1, const double* K,
                      double tiny, double* s1, double* l1, double* s2, double* l2) {
  for (int64_t k = k0; k < k1; ++k) {
    const T* row = base + k * w;
    for (int64_t i = 0; i < w; ++i) {
      double yh, yl, s, e, qh, ql;
      two_sum(flushed(row[i], tiny), -K[i], yh, yl);
      two_sum(s1[i], yh, s, e);
      s1[i] = s;
      l1[i] += e + yl;
      square(yh, yl, qh, ql);
      two_sum(s2[i], qh, s, e);
      s2[i] = s;
      l2[i] += e + ql;
    }
  }
}

// Partial sums of a task, one array per quantity (columns vectorise); l1, l2 only for
// pairs.  Each array has 16 doubles of padding at its end, so that the sums of two threads
// never share a cache line.
struct SumArrays {
  static constexpr size_t kPad = 16;
  size_t m;
  std::vector<double> h1, l1, h2, l2;
  SumArrays(size_t m_, bool pairs)
      : m(m_),
        h1(m + kPad, 0.0),
        l1(pairs ? m + kPad : 0, 0.0),
        h2(m + kPad, 0.0),
        l2(pairs ? m + kPad : 0, 0.0) {}
  Sums at(size_t s) const {
    return l1.empty() ? Sums{h1[s], 0.0, h2[s], 0.0} : Sums{h1[s], l1[s], h2[s], l2[s]};
  }
  void add(const SumArrays& b) {
    const bool pairs = !l1.empty();
    for (size_t s = 0; s < m; ++s) {
      if (!pairs) {
        h1[s] += b.h1[s];
        h2[s] += b.h2[s];
        continue;
      }
      double t, e;
      two_sum(h1[s], b.h1[s], t, e);
      h1[s] = t;
      l1[s] += e + b.l1[s];
      two_sum(h2[s], b.h2[s], t, e);
      h2[s] = t;
      l2[s] += e + b.l2[s];
    }
  }
};

// Rows per block of the float64 sums (section 4, "depth"): a power of two near sqrt(n),
// at least 256 (smaller blocks cost more than they gain).  Each block of a slice is summed from zero and then added into the slice's
// running sum, so that no term passes through more than about 2 sqrt(n) additions, where
// one running sum over the whole slice took n - 1 (the bound of a sum grows with that
// depth: float32 N(0, 1) with n = 65536 left a third of its slices to the exact path).
inline int64_t block_rows(int64_t n) {
  int64_t b = 256;
  while (b * b < n) b *= 2;
  return b;
}

// The most additions any term of one slice passes through in the float64 sums below, for
// n rows cut into `chunks` row ranges summed into `partials` partial sums that are added
// at the end: at most B - 1 inside its block (any tree of B terms), then one per block
// added into the same running sum (ceil(n / B) blocks, one more per chunk boundary), then
// partials - 1.
inline double sum_depth(int64_t n, int64_t chunks, int partials) {
  const int64_t b = block_rows(n);
  return static_cast<double>((b - 1) + (n + b - 1) / b + chunks + (partials - 1));
}

// The sums of blocks o in [o0, o1), rows [k0, k1), every column, added into out; float64
// sums in blocks of block_rows(n) rows (pairs: one compensated sum, bounded for any tree).
template <typename T>
void block_sums(const T* x, int64_t n, int64_t w, int64_t o0, int64_t o1, int64_t k0,
                int64_t k1, const double* K, bool pairs, double tiny, SumArrays& out) {
  const int64_t rows = block_rows(n);
  std::vector<double> part(pairs || w == 1 ? 0 : static_cast<size_t>(2 * w));
  for (int64_t o = o0; o < o1; ++o) {
    const T* base = x + o * n * w;
    const size_t s = static_cast<size_t>(o * w);
    if (pairs) {
      column_pair_sums(base, w, k0, k1, K + s, tiny, &out.h1[s], &out.l1[s], &out.h2[s],
                       &out.l2[s]);
      continue;
    }
    for (int64_t b0 = k0; b0 < k1; b0 += rows) {
      const int64_t b1 = std::min(k1, b0 + rows);
      if (w == 1) {
        double t1 = 0.0, t2 = 0.0;
        row_sums(base + b0, b1 - b0, K[s], tiny, t1, t2);
        out.h1[s] += t1;
        out.h2[s] += t2;
        continue;
      }
      std::fill(part.begin(), part.end(), 0.0);
      column_sums(base, w, b0, b1, K + s, tiny, part.data(), part.data() + w);
      for (int64_t i = 0; i < w; ++i) {
        out.h1[s + i] += part[i];
        out.h2[s + i] += part[w + i];
      }
    }
  }
}

// Inputs below which one thread does all the work (starting threads costs more).
constexpr int64_t kThreadMin = int64_t(1) << 20;

// The threads a call may use where its framework does not say (the JAX FFI call, the
// TensorFlow XLA custom call): the machine's, at most 8.
inline int machine_threads() {
  unsigned hw = std::thread::hardware_concurrency();
  return static_cast<int>(std::min<unsigned>(std::max<unsigned>(hw, 1u), 8u));
}

// work(c, slot) for every chunk c < chunks, by the calling thread (slot 0) and up to
// `helpers` detached threads (slots 1...), each claiming the next chunk while any is left.
// Returns when every chunk is done.  A helper touches the caller's data only inside a chunk
// it claimed; one that starts after the last chunk was claimed finds none and exits (it
// holds the counters, not the caller's frame).  A thread that cannot be started is no error:
// the others do its share.
struct ChunkCounters {
  std::atomic<int64_t> next{0}, done{0};
};
template <typename Work>
void run_chunks(int helpers, int64_t chunks, const Work& work) {
  auto counters = std::make_shared<ChunkCounters>();
  auto body = [counters, chunks](int slot, const Work& w) {
    for (;;) {
      const int64_t c = counters->next.fetch_add(1, std::memory_order_relaxed);
      if (c >= chunks) return;
      w(c, slot);
      counters->done.fetch_add(1, std::memory_order_release);
    }
  };
  for (int h = 1; h <= helpers && h < chunks; ++h) {
    try {
      std::thread(body, h, work).detach();
    } catch (const std::system_error&) {
      break;
    }
  }
  body(0, work);
  while (counters->done.load(std::memory_order_acquire) < chunks) std::this_thread::yield();
}

// rows(first, last) over [0, count): one call without helpers, else up to 4 (helpers + 1)
// contiguous ranges claimed as chunks (run_chunks).  For work where each row is its own.
template <typename Rows>
void run_ranges(int helpers, int64_t count, const Rows& rows) {
  const int64_t chunks = helpers ? std::min<int64_t>(count, 4 * (helpers + 1)) : 1;
  if (chunks <= 1) {
    rows(int64_t{0}, count);
    return;
  }
  run_chunks(helpers, chunks, [&](int64_t c, int) {
    rows(c * count / chunks, (c + 1) * count / chunks);
  });
}

// ------------------------------------------------------------------ bounds (section 4)
struct Approx {
  Pair mean;
  double mean_err;
  Pair num;
  double num_err;
  bool bad;
  bool exact = false, exact_mean = false;  // sums exact on the inputs' lattice (section 5)
};

// moments_core/_kernel.py `approximate`, term for term, with `depth` where it has n in the
// gammas: an upper bound of 1 + the additions any term passed through (n there, for any
// order; `sum_depth` + 1 for the blocked sums here).  With the lattice unit q of the
// slice's smallest magnitude (`unit` > 0, section 5) it also finds where the sums are
// exact and drops their error terms there, as `approximate` does; unit 0: no lattice.
inline Approx approximate(double k, double s1, double s2, double n, double depth, Pair rn,
                          double unit = 0.0) {
  Approx a;
  a.bad = !std::isfinite(s2) || !std::isfinite(s1);
  double b_up = s2 * (1.0 + 2.0 * gamma(depth + 2.0)) * kMargin;
  double a_abs = std::sqrt(n * b_up) * kMargin;
  if (unit > 0.0 && !a.bad) {
    a.exact = b_up <= 0x1p52 * unit * unit && n * b_up <= 0x1p104 * unit * unit;
    a.exact_mean = a_abs <= 0x1p52 * unit;
  }
  double d2 = a.exact ? 0.0 : gamma(depth + 2.0) * b_up;
  double d1 = a.exact_mean ? 0.0 : gamma(depth + 1.0) * a_abs * kMargin;
  double t = s1 * rn.h;
  double mean = k + t;
  double mean_err = ((d1 + 3.0 * kU * std::fabs(s1)) * rn.h * kMargin + kU * std::fabs(t)) * kMargin;
  mean_err = (mean_err + kU * std::fabs(mean)) * kMargin;
  double corr = (s1 * s1) * rn.h;
  double d_corr = d1 * (2.0 * std::fabs(s1) + d1) * rn.h * kMargin + 4.0 * kU * std::fabs(corr);
  double num = s2 - corr;
  a.mean = {mean, 0.0};
  a.mean_err = mean_err;
  a.num = {num, 0.0};
  a.num_err = (d2 + d_corr + kU * std::fabs(num)) * kMargin;
  return a;
}

// moments_core/_kernel.py `approximate_pairs`, term for term.
inline Approx approximate_pairs(double k, const Sums& sm, double n, Pair rn) {
  Approx a;
  Pair s1, s2;
  two_sum(sm.h1, sm.l1, s1.h, s1.l);
  two_sum(sm.h2, sm.l2, s2.h, s2.l);
  a.bad = !std::isfinite(s2.h) || !std::isfinite(s1.h) || !std::isfinite(s2.l + s1.l);
  double u2 = kU * kU;
  double b_up = (s2.h + std::fabs(s2.l)) * (1.0 + 4.0 * n * kU) * kMargin + n * kTiny;
  double e2 = (gamma(2.0 * n + 2.0) * (n + 3.0) * kU + 32.0 * u2) * b_up * kMargin + n * kTiny;
  double a_abs = std::sqrt(n * b_up) * kMargin;
  double e1 = gamma(2.0 * n + 2.0) * (n + 1.0) * kU * a_abs * kMargin + n * kTiny;
  Pair t = df_mul(s1, rn);
  Pair mean = df_add({k, 0.0}, t);
  double abs_s1 = std::fabs(s1.h) + std::fabs(s1.l);
  double mean_err =
      (e1 * rn.h + 26.0 * u2 * std::fabs(t.h) + 4.0 * u2 * abs_s1 * rn.h) * kMargin;
  mean_err = (mean_err + 8.0 * u2 * (std::fabs(k) + std::fabs(t.h)) + kTiny) * kMargin;
  Pair corr = df_mul(df_mul(s1, rn), s1);
  double e_corr = ((2.0 * abs_s1 + e1) * e1 * rn.h + 56.0 * u2 * std::fabs(corr.h)) * kMargin;
  Pair num = df_add(s2, {-corr.h, -corr.l});
  double num_err = e2 + e_corr + 8.0 * u2 * (std::fabs(s2.h) + std::fabs(corr.h)) + kTiny;
  bool constant = s1.h == 0.0 && s1.l == 0.0 && s2.h == 0.0 && s2.l == 0.0 &&
                  std::fabs(k) >= std::ldexp(1.0, -450);
  a.mean = mean;
  a.mean_err = constant ? 0.0 : mean_err;
  a.num = num;
  a.num_err = constant ? 0.0 : num_err * kMargin;
  return a;
}

// moments_core/_kernel.py `combine_nums`: the two parts' numerators of a complex slice.
inline void combine_nums(const Approx& a, const Approx& b, bool pairs, Pair& num,
                         double& err) {
  num = df_add(a.num, b.num);
  double size = std::fabs(a.num.h) + std::fabs(b.num.h);
  err = (a.num_err + b.num_err) * kMargin + 8.0 * kU * kU * size;
  if (!pairs) err = err + kU * std::fabs(num.h);  // variance_of keeps the high part only
  err = err * kMargin;
}

// moments_core/_kernel.py `variance_of`: (v, err) = num / (n - ddof) and its bound.
inline void variance_of(Pair num, double num_err, Pair rd, bool pairs, Pair& v, double& err) {
  if (pairs) {
    v = df_mul(num, rd);
    err = (num_err * rd.h * kMargin + 27.0 * kU * kU * std::fabs(v.h)) * kMargin;
    err = num_err == 0.0 ? 0.0 : err + kTiny;
  } else {
    v = {num.h * rd.h, 0.0};
    err = (num_err * rd.h * kMargin + 3.0 * kU * std::fabs(v.h)) * kMargin;
  }
}

// ------------------------------------------------------------------ ties on the lattice (section 5)
// One real part with float64 sums (precision <= 24), whose inputs are all multiples of
// q, the unit in the last place of the smallest nonzero |x| in its format: where the sums
// are small next to q they are exact, and an exact value that lies on a lattice is
// decided even on a midpoint.  moments_core/_kernel.py `approximate` (its exact sums),
// `variance_from_exact_sums` and `certify` with `tie`, term for term.  The native kernel
// tries it on the slices the plain test leaves open (exact ties of the data, mostly: one
// slice in 16 of float32 N(1e6, 1) with n = 1024, one in 11 of N(0, 1) with n = 8), as
// they pass to the exact path: it needs the smallest magnitude, which the fast pass does
// not track, and reads those slices once more instead of binning them.

// `certify` with tie = (where, grid, scale): where it holds, the exact value times D lies
// in grid * Z for an integer D with 1/D >= scale (1 + 2**-19); a midpoint M is a multiple
// of a quarter of the candidate's unit, so V != M is at least sep away from M.
inline bool certify_tie(Pair v, double err, const Format& f, bool where, double grid,
                        double scale, double& out) {
  double tiny = pow2(f.emin);
  bool negative = v.h < 0;
  double a = std::fabs(v.h);
  double low = negative ? -v.l : v.l;
  bool zero = a < 0.25 * tiny && std::fabs(low) < 0.25 * tiny && err < 0.25 * tiny;
  bool ok = a >= 0.25 * tiny && a < pow2(1000);
  double safe = ok ? a : 1.0;
  Nearest nr = nearest(safe, f);
  double gap = std::min(nr.hi - safe, safe - nr.lo);
  double value = nr.c;
  double unit = pow2(exponent_of(safe) - (f.precision - 1));
  double sep = std::min(grid, 0.25 * unit) * scale * (1.0 - 1.0 / 262144.0);
  double mid = nr.hi - safe <= safe - nr.lo ? nr.hi : nr.lo;
  bool on_lattice = ok && where && err + err < sep;
  if (on_lattice && gap <= err) value = nearest(mid, f).c;
  if (value >= pow2(f.emax)) value = std::numeric_limits<double>::infinity();
  if (value < tiny) value = 0.0;
  bool decided = (ok && err + err < gap) || zero || on_lattice;
  if (zero) value = 0.0;
  if (negative && value != 0.0) value = -value;
  out = value;
  return decided;
}

// The smallest |x| >= 2**emin (flushed: below it, 0) of x[k * stride], k < n; inf if none.
template <typename T>
double smallest_magnitude(const T* x, int64_t n, int64_t stride, double tiny) {
  double m = std::numeric_limits<double>::infinity();
  for (int64_t k = 0; k < n; ++k) {
    double a = std::fabs(static_cast<double>(x[k * stride]));
    if (a >= tiny && a < m) m = a;
  }
  return m;
}

// Mean and variance of one slice (K, s1 = sum y, s2 = sum y**2, its smallest magnitude)
// by the lattice rules; false where they do not decide both.
inline bool lattice_moments(double k, double s1, double s2, double smallest, double n,
                            double depth, Pair rn, Pair rd, bool defined, const Format& f,
                            double& mean, double& var) {
  if (!std::isfinite(smallest)) return false;
  double unit = pow2(std::min(exponent_of(smallest), 1000) - (f.precision - 1));
  Approx a = approximate(k, s1, s2, n, depth, rn, unit);
  if (a.bad || !certify_tie(a.mean, a.mean_err, f, a.exact_mean, unit, rn.h, mean)) {
    return false;
  }
  if (!defined) {
    var = std::numeric_limits<double>::quiet_NaN();
    return true;
  }
  Pair v;
  double err;
  if (a.exact) {  // variance_from_exact_sums
    const double u2 = kU * kU;
    // t = s1 rn within 17 u**2 |t| (a df_mul with a zero low part) and rn within u**2 / n:
    // 18 u**2; corr = t s1 within 17 u**2 |corr| more: 35; w = num rd within 26 u**2 |w|.
    Pair corr = df_mul(df_mul({s1, 0.0}, rn), {s1, 0.0});
    Pair num = df_add({s2, 0.0}, {-corr.h, -corr.l});
    Pair w = df_mul(num, rd);
    double num_err = (8.0 * u2 * (std::fabs(s2) + std::fabs(corr.h)) + 36.0 * u2 * std::fabs(corr.h)) * kMargin;
    err = (num_err * rd.h + u2 * std::fabs(num.h) * rd.h + 26.0 * u2 * std::fabs(w.h)) * kMargin;
    v = {w.h + w.l, 0.0};
    err = (err + kU * std::fabs(v.h)) * kMargin;
  } else {
    variance_of(a.num, a.num_err, rd, false, v, err);
  }
  return certify_tie(v, err, f, a.exact, unit * unit, rn.h * rd.h, var);
}

// ------------------------------------------------------------------ exact path (section 7)
// Non-negative big integers, little-endian 64-bit limbs.  Every step is exact.
using Big = std::vector<uint64_t>;

inline void trim(Big& a) {
  while (!a.empty() && a.back() == 0) a.pop_back();
}
inline void add_word(Big& a, uint64_t w, size_t limb) {  // a += w * 2**(64 limb)
  while (w) {
    if (limb >= a.size()) a.resize(limb + 1, 0);
    uint64_t s = a[limb] + w;
    w = s < w ? 1 : 0;
    a[limb] = s;
    ++limb;
  }
}
inline void add_shifted(Big& a, unsigned __int128 v, int64_t bit) {  // a += v * 2**bit
  size_t limb = static_cast<size_t>(bit / 64);
  int sh = static_cast<int>(bit % 64);
  uint64_t parts[2] = {static_cast<uint64_t>(v), static_cast<uint64_t>(v >> 64)};
  for (int j = 0; j < 2; ++j) {
    uint64_t w = parts[j];
    if (!w) continue;
    add_word(a, w << sh, limb + j);
    if (sh) add_word(a, w >> (64 - sh), limb + j + 1);
  }
}
inline int cmp(const Big& a, const Big& b) {  // both trimmed
  if (a.size() != b.size()) return a.size() < b.size() ? -1 : 1;
  for (size_t i = a.size(); i-- > 0;)
    if (a[i] != b[i]) return a[i] < b[i] ? -1 : 1;
  return 0;
}
inline Big sub(const Big& a, const Big& b) {  // a - b for a >= b
  Big r(a);
  uint64_t borrow = 0;
  for (size_t i = 0; i < r.size(); ++i) {
    uint64_t bi = i < b.size() ? b[i] : 0;
    uint64_t d = r[i] - bi - borrow;
    borrow = (r[i] < bi || (r[i] - bi) < borrow) ? 1 : 0;
    r[i] = d;
  }
  trim(r);
  return r;
}
inline Big add(const Big& a, const Big& b) {
  Big r(a);
  for (size_t i = 0; i < b.size(); ++i) add_word(r, b[i], i);
  trim(r);
  return r;
}
inline Big mul(const Big& a, const Big& b) {
  Big r(a.size() + b.size() + 1, 0);
  for (size_t i = 0; i < a.size(); ++i) {
    unsigned __int128 carry = 0;
    for (size_t j = 0; j < b.size(); ++j) {
      unsigned __int128 t = (unsigned __int128)a[i] * b[j] + r[i + j] + carry;
      r[i + j] = static_cast<uint64_t>(t);
      carry = t >> 64;
    }
    size_t k = i + b.size();
    while (carry) {
      unsigned __int128 t = (unsigned __int128)r[k] + carry;
      r[k++] = static_cast<uint64_t>(t);
      carry = t >> 64;
    }
  }
  trim(r);
  return r;
}
inline Big shl(const Big& a, int bits) {
  Big r(a.size() + bits / 64 + 1, 0);
  int sh = bits % 64;
  for (size_t i = 0; i < a.size(); ++i) {
    r[i + bits / 64] |= a[i] << sh;
    if (sh) r[i + bits / 64 + 1] |= a[i] >> (64 - sh);
  }
  trim(r);
  return r;
}
inline uint64_t divmod(Big& a, uint64_t d) {  // a = floor(a / d); returns the remainder
  unsigned __int128 rem = 0;
  for (size_t i = a.size(); i-- > 0;) {
    unsigned __int128 cur = (rem << 64) | a[i];
    a[i] = static_cast<uint64_t>(cur / d);
    rem = cur % d;
  }
  trim(a);
  return static_cast<uint64_t>(rem);
}
inline int64_t bit_length(const Big& a) {  // trimmed
  if (a.empty()) return 0;
  return 64 * static_cast<int64_t>(a.size() - 1) + (64 - __builtin_clzll(a.back()));
}
inline bool bit(const Big& a, int64_t i) {
  return (a[static_cast<size_t>(i / 64)] >> (i % 64)) & 1;
}
inline bool any_below(const Big& a, int64_t i) {  // any bit below position i set
  for (int64_t limb = 0; limb < i / 64; ++limb)
    if (a[static_cast<size_t>(limb)]) return true;
  return i % 64 && (a[static_cast<size_t>(i / 64)] & ((uint64_t(1) << (i % 64)) - 1));
}

// (num / (d1 d2)) * 2**scale rounded once to f: nearest, ties to even, then overflow to inf
// and results below 2**emin to 0 (the oracle's round_rational).  floor(floor(a/b)/c) ==
// floor(a/(bc)), and the remainder is zero iff both are: one exact quotient and sticky bit.
inline double round_ratio(Big num, bool negative, int64_t scale, uint64_t d1, uint64_t d2,
                          const Format& f) {
  trim(num);
  if (num.empty()) return 0.0;
  const int G = 192;  // q >= 2**(G - 128) > 2**(p + 2): enough bits for one rounding
  Big q = shl(num, G);
  bool sticky = divmod(q, d1) != 0;
  if (d2 != 1) sticky = (divmod(q, d2) != 0) || sticky;
  int64_t L = bit_length(q);
  int64_t drop = L - f.precision;  // > 0
  uint64_t m = 0;
  for (int64_t i = L - 1; i >= drop; --i) m = (m << 1) | (bit(q, i) ? 1 : 0);
  bool half = bit(q, drop - 1);
  sticky = sticky || any_below(q, drop - 1);
  if (half && (sticky || (m & 1))) ++m;
  int64_t e = scale - G + drop;  // value = m * 2**e
  if (m == (uint64_t(1) << f.precision)) {
    m >>= 1;
    ++e;
  }
  int64_t lead = e + f.precision - 1;  // 2**lead <= value < 2**(lead + 1)
  double value;
  if (lead >= f.emax) {
    value = std::numeric_limits<double>::infinity();
  } else if (lead < f.emin) {
    return 0.0;
  } else {
    value = std::ldexp(static_cast<double>(m), static_cast<int>(e));
  }
  return negative ? -value : value;
}

// One part of one slice: exact integer sums and the special values it holds.
struct ExactPart {
  Big pos, neg, sq;  // S1 = pos - neg and S2 = sq, in units 2**base and 2**(2 base)
  uint64_t nan = 0, pinf = 0, ninf = 0;  // counts (the state keeps them; the kernel tests > 0)
};

// Significands binned by the input's own exponent field: bin E holds sum +-m and sum m**2
// of the inputs m * 2**(E - bias - mantissa bits).  Integer adds are exact and associative;
// a float32 bin of n < 2**46 signed 24-bit m needs 70 bits, of m**2 94: 128-bit bins.  A
// float64 bin of m**2 (106 bits) carries into a 64-bit overflow count.  The bins are then
// added into big integers at their bit positions above 2**base (2**(2 base) for squares).
template <typename T>
struct Binned;
template <>
struct Binned<float> {
  static constexpr int kBins = 256, kMant = 23, kBias = 127;
};
template <>
struct Binned<double> {
  static constexpr int kBins = 2048, kMant = 52, kBias = 1023;
};

template <typename T>
class BinSums {
 public:
  using B = Binned<T>;
  using Bits = typename std::conditional<sizeof(T) == 4, uint32_t, uint64_t>::type;

  explicit BinSums(const Format& f)
      : flush_below_(f.emin + B::kBias), s1_(B::kBins, 0), s2_(B::kBins, 0), c2_(B::kBins, 0) {}

  // The inputs x[k * stride], k < n, added into the bins.  Consecutive inputs of one
  // exponent (the common case) are summed in registers first (a run: at most kRun
  // inputs, so that the run's sum of m**2 fits its 128 bits: 2**20 m**2 < 2**126), then
  // added into their bin: the same integers, added in another order.
  void add(const T* x, int64_t n, int64_t stride) {
    int cur = -1;  // the run's exponent field (no run yet)
    __int128 r1 = 0;
    unsigned __int128 r2 = 0;
    int64_t count = 0;
    for (int64_t k = 0; k < n; ++k) {
      Bits b;
      std::memcpy(&b, x + k * stride, sizeof(T));
      const int e = static_cast<int>((b >> B::kMant) & (B::kBins - 1));
      if (e != cur || count == kRun) {
        if (e == B::kBins - 1) {  // Inf or NaN
          if (b & kMantMask) {
            ++r_.nan;
          } else {
            ++((b >> (8 * sizeof(T) - 1)) ? r_.ninf : r_.pinf);
          }
          continue;
        }
        // |v| < 2**emin (zeros and subnormals too): flushed (section 2)
        if (e < flush_below_) continue;
        spill(cur, r1, r2);
        cur = e;
        count = 0;
      }
      const uint64_t m = static_cast<uint64_t>((b & kMantMask) | (Bits(1) << B::kMant));
      r1 += (b >> (8 * sizeof(T) - 1)) ? -(__int128)m : (__int128)m;
      r2 += (unsigned __int128)m * m;
      ++count;
    }
    spill(cur, r1, r2);
  }

  // The bins added into big integers at their bit positions: bin e holds values
  // m 2**(e - bias - mant) = m 2**(base + at).  The bins are left empty for the next slice.
  ExactPart finish(const Format& f) {
    ExactPart r = r_;
    r_ = ExactPart();
    const int base = f.base();
    for (int e = lo_; e <= hi_; ++e) {
      int64_t at = static_cast<int64_t>(e) - B::kBias - B::kMant - base;  // >= 0: not flushed
      if (s1_[e] != 0) {
        bool neg = s1_[e] < 0;
        unsigned __int128 mag = neg ? (unsigned __int128)(-s1_[e]) : (unsigned __int128)s1_[e];
        add_shifted(neg ? r.neg : r.pos, mag, at);
      }
      if (s2_[e] != 0) add_shifted(r.sq, s2_[e], 2 * at);
      if (c2_[e] != 0) add_shifted(r.sq, c2_[e], 2 * at + 128);
      s1_[e] = 0;
      s2_[e] = 0;
      c2_[e] = 0;
    }
    lo_ = B::kBins;
    hi_ = -1;
    trim(r.pos);
    trim(r.neg);
    trim(r.sq);
    return r;
  }

 private:
  static constexpr Bits kMantMask = (Bits(1) << B::kMant) - 1;
  static constexpr int64_t kRun = int64_t(1) << 20;
  void spill(int e, __int128& r1, unsigned __int128& r2) {
    if (e < 0) return;
    s1_[e] += r1;
    unsigned __int128 t = s2_[e] + r2;
    c2_[e] += t < r2 ? 1 : 0;
    s2_[e] = t;
    lo_ = std::min(lo_, e);
    hi_ = std::max(hi_, e);
    r1 = 0;
    r2 = 0;
  }
  int flush_below_;  // biased exponent of 2**emin: inputs with a smaller field flush to 0
  std::vector<__int128> s1_;
  std::vector<unsigned __int128> s2_;
  std::vector<uint64_t> c2_;
  int lo_ = B::kBins, hi_ = -1;  // the bins filled since the last finish
  ExactPart r_;
};

template <typename T>
ExactPart exact_part(const T* x, int64_t n, int64_t stride, const Format& f) {
  BinSums<T> bins(f);
  bins.add(x, n, stride);
  return bins.finish(f);
}

// Mean (per part) and variance of one slice from its exact parts, with the special values
// of section 8: a NaN, or both infinities, make a part's mean NaN, one infinity makes it
// that infinity; any of them makes the variance NaN.
inline void exact_result(const ExactPart* ex, int parts, int64_t n, int64_t ddof,
                         const Format& f, double* means, double& var) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  bool special = false;
  Big numerator;
  for (int j = 0; j < parts; ++j) {
    const ExactPart& e = ex[j];
    bool neg = cmp(e.neg, e.pos) > 0;
    Big a = neg ? sub(e.neg, e.pos) : sub(e.pos, e.neg);
    means[j] = round_ratio(a, neg, f.base(), static_cast<uint64_t>(n), 1, f);
    if (e.nan || (e.pinf && e.ninf)) {
      means[j] = nan;
    } else if (e.pinf || e.ninf) {
      means[j] = e.pinf ? inf : -inf;
    }
    special = special || e.nan || e.pinf || e.ninf;
    Big ns = mul(e.sq, Big{static_cast<uint64_t>(n)});
    numerator = add(numerator, sub(ns, mul(a, a)));  // n S2 - S1**2 >= 0 (exact)
  }
  var = (special || n - ddof <= 0)
            ? nan
            : round_ratio(numerator, false, 2 * static_cast<int64_t>(f.base()),
                          static_cast<uint64_t>(n), static_cast<uint64_t>(n - ddof), f);
}

// ------------------------------------------------------------------ the whole kernel
struct Result {
  int64_t undecided = 0;  // slices the rounding tests (plain, then lattice) left to the exact path
};

// x: [outer, n, inner, parts] (parts 1, or 2 for the real and imaginary parts of complex
// data).  Writes mean [outer, inner, parts] and var [outer, inner] as values of f.
template <typename T>
Result moments(const T* x, int64_t outer, int64_t n, int64_t inner, int parts, int64_t ddof,
               const Format& f, T* mean_out, T* var_out, int threads) {
  Result res;
  const int64_t width = inner * parts;  // columns of the [outer, n, width] view
  const int64_t slices = outer * width;
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const bool defined = n - ddof > 0;
  if (slices == 0) return res;
  if (n == 0) {
    for (int64_t s = 0; s < slices; ++s) mean_out[s] = static_cast<T>(nan);
    for (int64_t s = 0; s < outer * inner; ++s) var_out[s] = static_cast<T>(nan);
    return res;
  }
  const bool pairs = !f.wide();
  const double tiny = std::ldexp(1.0, f.emin);
  // K per column: the slice's first element, flushed.
  std::vector<double> K(static_cast<size_t>(slices));
  for (int64_t o = 0; o < outer; ++o)
    for (int64_t i = 0; i < width; ++i) K[o * width + i] = flushed(x[o * n * width + i], tiny);
  // Work split: chunks of blocks o when there are as many blocks as threads (disjoint
  // sums), else chunks of rows, each participant adding its rows into sums of its own
  // (added at the end); the memory of a chunk is contiguous either way.  One thread below
  // kThreadMin inputs.  Chunks are claimed while they last (run_chunks): a helper thread
  // that the machine runs late leaves its share to the others instead of delaying the call.
  const int64_t total = slices * n;
  int T_ = std::max(1, threads);
  if (total < kThreadMin) T_ = 1;
  SumArrays acc(static_cast<size_t>(slices), pairs);
  const double* Kp = K.data();
  double depth = sum_depth(n, 1, 1) + 1.0;  // the float64 sums' bound (approximate)
  if (T_ == 1) {
    block_sums(x, n, width, 0, outer, 0, n, Kp, pairs, tiny, acc);
  } else if (outer >= T_) {
    const int64_t chunks = std::min<int64_t>(outer, 8 * T_), step = (outer + chunks - 1) / chunks;
    run_chunks(T_ - 1, (outer + step - 1) / step, [&](int64_t c, int) {
      block_sums(x, n, width, c * step, std::min(outer, (c + 1) * step), 0, n, Kp, pairs, tiny,
                 acc);
    });
  } else {
    const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(8 * T_, n / 64));
    const int64_t step = (n + chunks - 1) / chunks;
    depth = sum_depth(n, (n + step - 1) / step, T_) + 1.0;
    std::vector<SumArrays> part(T_ - 1, SumArrays(static_cast<size_t>(slices), pairs));
    run_chunks(T_ - 1, (n + step - 1) / step, [&](int64_t c, int slot) {
      block_sums(x, n, width, 0, outer, c * step, std::min(n, (c + 1) * step), Kp, pairs, tiny,
                 slot == 0 ? acc : part[slot - 1]);
    });
    for (auto& p : part) acc.add(p);
  }
  // Rounding test per slice; the slices it leaves open are listed for the exact path.
  const double nf = static_cast<double>(n);
  const Pair rn = reciprocal_pair(n);
  const Pair rd = reciprocal_pair(std::max<int64_t>(n - ddof, 1));
  std::vector<int64_t> open;  // o * inner + i
  for (int64_t o = 0; o < outer; ++o) {
    for (int64_t i = 0; i < inner; ++i) {
      bool decided = true;
      double means[2] = {0.0, 0.0};
      Approx ap[2];
      for (int j = 0; j < parts; ++j) {
        int64_t s = o * width + i * parts + j;
        Sums sm = acc.at(static_cast<size_t>(s));
        ap[j] = pairs ? approximate_pairs(K[s], sm, nf, rn)
                      : approximate(K[s], sm.h1, sm.h2, nf, depth, rn);
        decided = decided && !ap[j].bad && certify(ap[j].mean, ap[j].mean_err, f, means[j]);
      }
      Pair num = ap[0].num;
      double num_err = ap[0].num_err;
      if (parts == 2) combine_nums(ap[0], ap[1], pairs, num, num_err);
      double var = nan;
      if (defined && decided) {  // variance_of, then the test
        Pair v;
        double err;
        variance_of(num, num_err, rd, pairs, v, err);
        decided = certify(v, err, f, var);
      }
      if (!decided) open.push_back(o * inner + i);
      for (int j = 0; j < parts; ++j)
        mean_out[(o * inner + i) * parts + j] = static_cast<T>(means[j]);
      var_out[o * inner + i] = static_cast<T>(var);
    }
  }
  res.undecided = static_cast<int64_t>(open.size());
  // The exact path.  Slices that are columns are first gathered, the open columns of one
  // o together (up to a 16 MiB buffer, at least 64 columns), while the rows stream past
  // once (read alone, a column would miss the cache on every element), into a buffer
  // [n, columns] written in order; then each slice is binned from there (or, a row, from
  // x itself).  One set of bins serves every slice (finish empties it).
  BinSums<T> bins(f);
  std::unique_ptr<T[]> buf;
  const size_t group = std::max<size_t>(
      64, (size_t(1) << 24) / (sizeof(T) * parts * static_cast<size_t>(n)));
  if (width > 1 && !open.empty())
    buf.reset(new T[std::min(open.size(), group) * parts * static_cast<size_t>(n)]);
  std::vector<int64_t> cols;
  size_t at = 0;
  while (at < open.size()) {
    const int64_t o = open[at] / inner;
    size_t end = at;
    while (end < open.size() && open[end] / inner == o && end - at < group) ++end;
    const T* block = x + o * n * width;
    const int64_t m = static_cast<int64_t>(end - at) * parts;  // gathered columns
    if (width > 1) {
      cols.clear();  // the gathered columns' offsets in a row
      for (size_t q = at; q < end; ++q)
        for (int j = 0; j < parts; ++j) cols.push_back((open[q] % inner) * parts + j);
      T* out = buf.get();
      for (int64_t k = 0; k < n; ++k) {
        const T* row = block + k * width;
        for (const int64_t c : cols) *out++ = row[c];
      }
    }
    for (size_t q = at; q < end; ++q) {
      if (parts == 1 && !pairs) {  // ties on the lattice first (section 5)
        const T* p = width > 1 ? buf.get() + (q - at) : block;
        const double small = smallest_magnitude(p, n, width > 1 ? m : 1, tiny);
        const Sums sm = acc.at(static_cast<size_t>(open[q]));
        double mean, var;
        if (lattice_moments(K[open[q]], sm.h1, sm.h2, small, nf, depth, rn, rd, defined, f,
                            mean, var)) {
          mean_out[open[q]] = static_cast<T>(mean);
          var_out[open[q]] = static_cast<T>(var);
          --res.undecided;
          continue;
        }
      }
      ExactPart ex[2];
      for (int j = 0; j < parts; ++j) {
        if (width > 1) {
          bins.add(buf.get() + (q - at) * parts + j, n, m);
        } else {
          bins.add(block, n, 1);
        }
        ex[j] = bins.finish(f);
      }
      double means[2], var;
      exact_result(ex, parts, n, ddof, f, means, var);
      for (int j = 0; j < parts; ++j) mean_out[open[q] * parts + j] = static_cast<T>(means[j]);
      var_out[open[q]] = static_cast<T>(var);
    }
    at = end;
  }
  return res;
}

// ------------------------------------------------------------------ the state (section 13)
// The mergeable moments state of moments_core/_state.py in one pass over the data: per
// slice the exact sums of the bins (ExactPart: the same integers S1 = sum X and
// S2 = sum X**2, X = x / 2**base, inputs below 2**emin counted as 0), written as the
// state's fields of radix-2**16 digits, little-endian:
//   n (3 digits), per part: S1 (l1 digits, two's complement modulo 2**(16 l1)),
//   NaN, +inf, -inf counts (3 digits each); S2 of all parts (l2 digits).
// The digits are canonical (each in [0, 2**16)), so they are the bits of the XLA and
// plain paths' states (`_state.from_one_pass`, `_state.from_rows`) for the same data.
struct StateLayout {
  int l1, l2, parts;  // the digits of S1 and S2 (`_state.Layout`), real parts
  int64_t size() const { return 3 + parts * (l1 + 9) + l2; }
};

inline uint32_t digit(const Big& a, int d) {  // digit d of a (radix 2**16)
  const size_t limb = static_cast<size_t>(d / 4);
  return limb < a.size() ? static_cast<uint32_t>((a[limb] >> (16 * (d % 4))) & 0xFFFF) : 0;
}

inline int32_t* put_count(int32_t* out, uint64_t v) {  // v < 2**48: 3 digits
  for (int d = 0; d < 3; ++d) *out++ = static_cast<int32_t>((v >> (16 * d)) & 0xFFFF);
  return out;
}

inline void write_state(const ExactPart* ex, int64_t n, const StateLayout& s, int32_t* out) {
  out = put_count(out, static_cast<uint64_t>(n));
  Big sq;
  for (int j = 0; j < s.parts; ++j) {
    int32_t borrow = 0;  // S1 = pos - neg, digit by digit; the borrow out of the top is dropped
    for (int d = 0; d < s.l1; ++d) {
      int32_t v = static_cast<int32_t>(digit(ex[j].pos, d)) -
                  static_cast<int32_t>(digit(ex[j].neg, d)) - borrow;
      borrow = v < 0 ? 1 : 0;
      *out++ = v + (borrow << 16);
    }
    out = put_count(out, ex[j].nan);
    out = put_count(out, ex[j].pinf);
    out = put_count(out, ex[j].ninf);
    sq = add(sq, ex[j].sq);
  }
  for (int d = 0; d < s.l2; ++d) *out++ = static_cast<int32_t>(digit(sq, d));
}

// The float inputs of columns [c0, c1) of a block [rows, width], summed exactly per column
// (ExactPart) in one pass.  Each column keeps an exponent field E and a window of W = 24
// fields below it: an input m 2**(e - 150) (m < 2**24 its significand, e its field) with
// E - W <= e <= E is the integer y = m 2**(e - E + W) < 2**48 in units 2**(E - W - 150), and
//   t1 = sum +-y,  y = a 2**24 + b (a, b < 2**24):  t2 = sum a**2, t3 = sum a b, t4 = sum b**2,
// so that sum y**2 = t2 2**48 + t3 2**25 + t4.  Every term is below 2**48: int64 sums of
// kFlush = 2**15 rows cannot overflow, and every add is exact, in any order.  Sixteen
// columns (AVX-512; else eight) run in the lanes of one vector; a vector holding an input
// outside its lane's window (e > E, or a normal input below E - W), NaN or Inf goes
// through `odd`, scalar:
// e > E spills the column's sums (into ex at their bit positions) and raises E to e + 2;
// inputs below the window go to int64 bins per field (`deep`, as `BinSums`); NaN and Inf
// are counted.  Inputs below 2**emin count as 0.  All sums are spilled every kFlush rows
// and at the end.  Stationary data raise E a few times, then run in vectors only.
typedef uint64_t v4q __attribute__((vector_size(32)));
typedef uint32_t v8w __attribute__((vector_size(32)));

// The vectors of ColumnSums for L columns: int32 lanes (I; W unsigned) and the products'
// L / 2 int64 lanes (Q; UQ unsigned).  mul: the products of the low 32 bits (unsigned)
// of each 64-bit lane; sll, srl: per-lane shifts of 32-bit lanes by 0..24 (one
// instruction each); any: whether a lane of a mask is set.  Sixteen columns (one 64-byte
// cache line of a row) where the machine has AVX-512, else eight.
template <int L>
struct Vectors;
template <>
struct Vectors<8> {
  typedef v8i I;
  typedef v8w W;
  typedef v4i Q;
  typedef v4q UQ;
#ifdef __AVX2__
  static Q mul(Q a, Q b) { return (Q)_mm256_mul_epu32((__m256i)a, (__m256i)b); }
  static I sll(I v, I s) { return (I)_mm256_sllv_epi32((__m256i)v, (__m256i)s); }
  static I srl(I v, I s) { return (I)_mm256_srlv_epi32((__m256i)v, (__m256i)s); }
#else
  static Q mul(Q a, Q b) { return (a & 0xFFFFFFFF) * (b & 0xFFFFFFFF); }
  static I sll(I v, I s) { return (I)((W)v << (W)s); }
  static I srl(I v, I s) { return (I)((W)v >> (W)s); }
#endif
  static bool any(I m) {
#ifdef __AVX__
    return !_mm256_testz_si256((__m256i)m, (__m256i)m);
#else
    int32_t r = 0;
    for (int l = 0; l < 8; ++l) r |= m[l];
    return r != 0;
#endif
  }
};
#ifdef __AVX512F__
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint32_t v16w __attribute__((vector_size(64)));
typedef int64_t v8q __attribute__((vector_size(64)));
typedef uint64_t v8uq __attribute__((vector_size(64)));
template <>
struct Vectors<16> {
  typedef v16i I;
  typedef v16w W;
  typedef v8q Q;
  typedef v8uq UQ;
  static Q mul(Q a, Q b) { return (Q)_mm512_mul_epu32((__m512i)a, (__m512i)b); }
  static I sll(I v, I s) { return (I)_mm512_sllv_epi32((__m512i)v, (__m512i)s); }
  static I srl(I v, I s) { return (I)_mm512_srlv_epi32((__m512i)v, (__m512i)s); }
  static bool any(I m) { return _mm512_test_epi32_mask((__m512i)m, (__m512i)m) != 0; }
};
constexpr int kWideLanes = 16;
#else
constexpr int kWideLanes = 8;
#endif

class ColumnSums {
 public:
  static constexpr int kW = 24, kHead = 2;
  static constexpr int64_t kFlush = int64_t(1) << 15, kRows = 64;

  ColumnSums(int64_t g, const Format& f, ExactPart* ex)
      : g_(g), flush_below_(f.emin + 127), base_(f.base()), ex_(ex),
        e_(static_cast<size_t>(g), flush_below_ - 1), t_(static_cast<size_t>(4 * g), 0) {}

  // Rows [0, rows) of the block (row k at block + k * width, the columns at offsets [0, g)).
  void add(const float* block, int64_t rows, int64_t width) {
    const int64_t gw = g_ / kWideLanes * kWideLanes, gv = g_ / 8 * 8;
    anchor(block, rows, width);
    for (int64_t k0 = 0; k0 < rows; k0 += kRows) {
      const int64_t k1 = std::min(rows, k0 + kRows);
      if (since_ + (k1 - k0) > kFlush) spill_all();
      since_ += k1 - k0;
      for (int64_t j = 0; j < gw; j += kWideLanes)
        vector_rows<kWideLanes>(block, k0, k1, width, j);
      for (int64_t j = gw; j < gv; j += 8) vector_rows<8>(block, k0, k1, width, j);
      for (int64_t k = k0; k < k1; ++k)
        for (int64_t c = gv; c < g_; ++c) odd(c, block[k * width + c]);
    }
  }

  // Columns that have seen no input yet start their window at the largest field among
  // their first kRows rows (plus kHead): their vectors then leave `run` for `odd` about
  // as rarely as later ones, not once per new largest input (each such exit spills the
  // column and reloads the lanes; JAX moments_state of [4096, 256] N(0, 1): 0.53-0.56 ->
  // 0.50-0.52 ms).  E is only where a window starts: every E gives the same sums.
  void anchor(const float* block, int64_t rows, int64_t width) {
    const int64_t k1 = std::min(rows, kRows);
    std::vector<int> top(static_cast<size_t>(g_), -1);
    for (int64_t k = 0; k < k1; ++k) {
      for (int64_t c = 0; c < g_; ++c) {
        uint32_t b;
        std::memcpy(&b, block + k * width + c, 4);
        const int e = static_cast<int>((b >> 23) & 0xFF);
        if (e != 0xFF && e >= flush_below_) top[c] = std::max(top[c], e);
      }
    }
    for (int64_t c = 0; c < g_; ++c) {
      int32_t& E = e_[static_cast<size_t>(c)];
      if (E == flush_below_ - 1 && top[c] >= 0) E = std::min(0xFE, top[c] + kHead);
    }
  }

  // Inputs of column c one by one (the tail of a row slice read as eight columns).
  void add_one(int64_t c, float v) {
    if (++since_ > kFlush) spill_all();
    odd(c, v);
  }

  // Every sum spilled into ex: the exact sums of all inputs added.
  void finish() {
    spill_all();
    for (int64_t c = 0; c < g_; ++c) {
      trim(ex_[c].pos);
      trim(ex_[c].neg);
      trim(ex_[c].sq);
    }
  }

 private:
  int64_t* t(int i, int64_t c) { return &t_[static_cast<size_t>(i * g_ + c)]; }

  template <int L>
  struct Lanes {  // t1..t4 of L columns: [i][0] columns 0, 2, 4, ..., [i][1] 1, 3, 5, ...
    typename Vectors<L>::Q t[4][2];
  };

  // Rows [k, k1) of L columns (p: their first, row k), k1 - k < 128, while no input is
  // odd (see the class comment): the sums updated, and the first odd row (k1 if none).  In
  // 32-bit lanes: the tests, a = y >> 24 = m >> (24 - s) and b = (m << s) mod 2**24, and
  // sum +-a, sum +-b (below 2**31 for 127 rows; widened into t1 = 2**24 sum +-a + sum +-b
  // at the end); the products a a, a b, b b (< 2**48) in 64-bit lanes, of the even and of
  // the odd columns (`Vectors::mul` multiplies the low halves of 64-bit lanes).  No call
  // and no member access inside, so that everything stays in registers.
  template <int L>
  __attribute__((noinline)) static int64_t run(const float* p, int64_t width, int64_t k,
                                               int64_t k1, typename Vectors<L>::I E,
                                               int flush_below, Lanes<L>& out) {
    using V = Vectors<L>;
    using I = typename V::I;
    using Q = typename V::Q;
    Lanes<L> acc = out;
    const I low = E - kW, flush = I{} + flush_below;
    I sa = {}, sb = {};
    for (; k < k1; ++k, p += width) {
      I x;
      std::memcpy(&x, p, sizeof(x));
      const I e = (I)(((typename V::W)x >> 23) & 0xFF);
      const I live = e >= flush;
      if (V::any((e > E) | (live & (e < low)))) break;  // NaN/Inf have e = 255 > E
      const I s = live & (e - low);                      // 0 <= s <= W
      const I m = live & ((x & 0x7FFFFF) | 0x800000);    // 0 for inputs that count as 0
      const I a = V::srl(m, kW - s), b = V::sll(m, s) & 0xFFFFFF;
      const I sign = x >> 31;  // -1 or 0
      sa += (a ^ sign) - sign;
      sb += (b ^ sign) - sign;
      const Q ae = (Q)a, be = (Q)b;
      const Q ao = (Q)((typename V::UQ)a >> 32), bo = (Q)((typename V::UQ)b >> 32);
      acc.t[1][0] += V::mul(ae, ae);
      acc.t[2][0] += V::mul(ae, be);
      acc.t[3][0] += V::mul(be, be);
      acc.t[1][1] += V::mul(ao, ao);
      acc.t[2][1] += V::mul(ao, bo);
      acc.t[3][1] += V::mul(bo, bo);
    }
    for (int l = 0; l < L; ++l)
      acc.t[0][l & 1][l >> 1] += static_cast<int64_t>(sa[l]) * (int64_t(1) << 24) + sb[l];
    out = acc;
    return k;
  }

  template <int L>
  void vector_rows(const float* block, int64_t k0, int64_t k1, int64_t width, int64_t j) {
    Lanes<L> a;
    typename Vectors<L>::I E;
    auto get = [&] {
      std::memcpy(&E, &e_[static_cast<size_t>(j)], sizeof(E));
      for (int i = 0; i < 4; ++i)
        for (int l = 0; l < L; ++l) a.t[i][l & 1][l >> 1] = *t(i, j + l);
    };
    auto put = [&] {
      for (int i = 0; i < 4; ++i)
        for (int l = 0; l < L; ++l) *t(i, j + l) = a.t[i][l & 1][l >> 1];
    };
    get();
    for (int64_t k = k0; k < k1; ++k) {
      k = run<L>(block + k * width + j, width, k, k1, E, flush_below_, a);
      if (k == k1) break;
      put();
      for (int l = 0; l < L; ++l) odd(j + l, block[k * width + j + l]);
      get();
    }
    put();
  }

  // One input of column c, scalar (see the class comment).
  void odd(int64_t c, float v) {
    uint32_t b;
    std::memcpy(&b, &v, 4);
    const int e = static_cast<int>((b >> 23) & 0xFF);
    ExactPart& x = ex_[c];
    if (e == 0xFF) {
      if (b & 0x7FFFFF) {
        ++x.nan;
      } else {
        ++((b >> 31) ? x.ninf : x.pinf);
      }
      return;
    }
    if (e < flush_below_) return;
    int32_t& E = e_[static_cast<size_t>(c)];
    if (e > E) {
      spill(c);
      E = std::min(0xFE, e + kHead);
    }
    const int64_t m = static_cast<int64_t>((b & 0x7FFFFF) | 0x800000);
    const bool neg = (b >> 31) != 0;
    if (e >= E - kW) {
      const int64_t y = m << (e - E + kW);
      *t(0, c) += neg ? -y : y;
      const int64_t a = y >> 24, r = y & 0xFFFFFF;
      *t(1, c) += a * a;
      *t(2, c) += a * r;
      *t(3, c) += r * r;
      return;
    }
    if (deep_.empty()) deep_.assign(static_cast<size_t>(512 * g_), 0);
    int64_t* bin = &deep_[static_cast<size_t>((c * 256 + e) * 2)];
    bin[0] += neg ? -m : m;
    bin[1] += m * m;
  }

  // The window sums of column c into its exact sums, at the bit positions of E (y in
  // units 2**(E - W - 150) = 2**(base + at), at >= 0 since E >= 2**emin's field - 1), and
  // its deep bins at theirs.
  void spill(int64_t c) {
    ExactPart& x = ex_[c];
    const int64_t at = e_[static_cast<size_t>(c)] - kW - 150 - base_;
    const int64_t s1 = *t(0, c);
    if (s1 != 0) add_shifted(s1 < 0 ? x.neg : x.pos, magnitude(s1), at);
    add_shifted(x.sq, static_cast<uint64_t>(*t(1, c)), 2 * at + 48);
    add_shifted(x.sq, static_cast<uint64_t>(*t(2, c)), 2 * at + 25);
    add_shifted(x.sq, static_cast<uint64_t>(*t(3, c)), 2 * at);
    for (int i = 0; i < 4; ++i) *t(i, c) = 0;
    if (deep_.empty()) return;
    for (int e = flush_below_; e < 0xFF; ++e) {
      int64_t* bin = &deep_[static_cast<size_t>((c * 256 + e) * 2)];
      const int64_t shift = e - 150 - base_;
      if (bin[0] != 0) add_shifted(bin[0] < 0 ? x.neg : x.pos, magnitude(bin[0]), shift);
      if (bin[1] != 0) add_shifted(x.sq, static_cast<uint64_t>(bin[1]), 2 * shift);
      bin[0] = bin[1] = 0;
    }
  }
  void spill_all() {
    for (int64_t c = 0; c < g_; ++c) spill(c);
    since_ = 0;
  }
  static unsigned __int128 magnitude(int64_t v) {
    return v < 0 ? static_cast<unsigned __int128>(-static_cast<__int128>(v))
                 : static_cast<unsigned __int128>(v);
  }

  int64_t g_, since_ = 0;  // columns; rows added since the last spill
  int flush_below_, base_;
  ExactPart* ex_;
  std::vector<int32_t> e_;     // E per column
  std::vector<int64_t> t_;     // t1..t4 per column: [4][g]
  std::vector<int64_t> deep_;  // [g][256][2]: sum +-m and sum m**2 per field, below windows
};

inline ExactPart merged(const ExactPart& a, const ExactPart& b) {  // the sums of both
  ExactPart r;
  r.pos = add(a.pos, b.pos);
  r.neg = add(a.neg, b.neg);
  r.sq = add(a.sq, b.sq);
  r.nan = a.nan + b.nan;
  r.pinf = a.pinf + b.pinf;
  r.ninf = a.ninf + b.ninf;
  return r;
}

// Rows (width 1) at least this long are read as eight columns (ColumnSums), shorter ones
// through BinSums.
constexpr int64_t kRowVectors = 256;

// The exact parts of columns [c0, c1) of a block [n, width] over its rows [k0, k1), into
// ex[0, c1 - c0).  float: ColumnSums, a row (width 1) of kRowVectors or more read as eight
// columns [(k1 - k0) / 8, 8] and its tail, the lanes added; else BinSums (one column at a
// time, through a stride).
template <typename T>
void rows_parts(const T* block, int64_t k0, int64_t k1, int64_t width, int64_t c0, int64_t c1,
                const Format& f, BinSums<T>& bins, ExactPart* ex) {
  const T* first = block + k0 * width;
  const int64_t rows = k1 - k0;
  if constexpr (std::is_same<T, float>::value) {
    if (width > 1) {
      ColumnSums sums(c1 - c0, f, ex);
      sums.add(first + c0, rows, width);
      sums.finish();
      return;
    }
    if (rows >= kRowVectors) {
      ExactPart lanes[8];
      ColumnSums sums(8, f, lanes);
      sums.add(first, rows / 8, 8);
      for (int64_t k = rows / 8 * 8; k < rows; ++k) sums.add_one(k % 8, first[k]);
      sums.finish();
      ExactPart total;
      for (const ExactPart& l : lanes) total = merged(total, l);
      ex[0] = total;
      return;
    }
  }
  for (int64_t c = c0; c < c1; ++c) {
    bins.add(first + c, rows, width);
    ex[c - c0] = bins.finish(f);
  }
}

// Slices with at least this many rows each may have their rows split between threads.
constexpr int64_t kSplitRows = int64_t(1) << 16;

// x [outer, n, inner, parts] -> out [outer, inner, size] int32: the state of every slice.
// Work items are blocks of slices: groups of 16 to 64 columns of one block o (at least a
// cache line of each row, and about four items per thread, so that a thread the machine
// runs late leaves its share to the others), or, for rows (width 1), runs of consecutive
// rows.  When there are fewer items than threads and the slices are long, each item's
// rows are cut into chunks too, summed into exact parts of their own and added at the
// end (integer sums: the same integers in another order).
template <typename T>
void state(const T* x, int64_t outer, int64_t n, int64_t inner, int parts, const Format& f,
           const StateLayout& s, int32_t* out, int threads) {
  const int64_t width = inner * parts, slices = outer * inner;
  if (slices == 0) return;
  int T_ = std::max(1, threads);
  if (slices * parts * n < kThreadMin) T_ = 1;
  int64_t per, groups;  // slices per item; items per block o
  if (width == 1) {
    per = std::max<int64_t>(1, outer / (8 * T_));
    groups = 1;
  } else {
    const int64_t lo = std::max<int64_t>(1, 16 / parts), hi = 64 / parts;
    per = std::min(hi, std::max(lo, (inner + 4 * T_ - 1) / (4 * T_)));
    // Few long slices: whole cache lines of each row in one item (up to 64 columns), its
    // rows cut into chunks below (a thread reading 16 of 64 columns streamed its rows at
    // a quarter of the memory's speed).
    if (outer < T_) per = std::min(hi, inner);
    groups = (inner + per - 1) / per;
  }
  const int64_t items = width == 1 ? (outer + per - 1) / per : outer * groups;
  const int64_t chunks =
      items < T_ && n >= kSplitRows ? std::min<int64_t>(4 * T_, n / (kSplitRows / 4)) : 1;
  const int64_t step = (n + chunks - 1) / chunks;
  const int64_t cols = width == 1 ? per : per * parts;  // columns (parts) of an item, at most
  std::vector<BinSums<T>> bins(static_cast<size_t>(T_), BinSums<T>(f));
  std::vector<ExactPart> split(static_cast<size_t>(chunks > 1 ? items * chunks * cols : 0));
  // The slices (blocks o, columns [c0, c1)) of an item.
  auto item_range = [&](int64_t item, int64_t& o0, int64_t& o1, int64_t& c0, int64_t& c1) {
    if (width == 1) {
      o0 = item * per, o1 = std::min(outer, o0 + per), c0 = 0, c1 = 1;
    } else {
      o0 = item / groups, o1 = o0 + 1;
      c0 = (item % groups) * per * parts, c1 = std::min(inner, (item % groups + 1) * per) * parts;
    }
  };
  auto write = [&](int64_t o, int64_t c0, int64_t c1, const ExactPart* ex) {
    for (int64_t c = c0; c < c1; c += parts)
      write_state(ex + (c - c0), n, s, out + (o * inner + c / parts) * s.size());
  };
  run_chunks(T_ - 1, items * chunks, [&](int64_t work, int slot) {
    const int64_t item = work / chunks, r = work % chunks;
    int64_t o0, o1, c0, c1;
    item_range(item, o0, o1, c0, c1);
    if (chunks > 1) {  // one chunk of rows of the item's one block (items < T_: per is 1)
      const int64_t k0 = std::min(n, r * step), k1 = std::min(n, k0 + step);
      rows_parts(x + o0 * n * width, k0, k1, width, c0, c1, f, bins[slot],
                 split.data() + work * cols);
      return;
    }
    std::vector<ExactPart> ex(static_cast<size_t>(c1 - c0));
    for (int64_t o = o0; o < o1; ++o) {
      rows_parts(x + o * n * width, 0, n, width, c0, c1, f, bins[slot], ex.data());
      write(o, c0, c1, ex.data());
    }
  });
  for (int64_t item = 0; chunks > 1 && item < items; ++item) {
    int64_t o0, o1, c0, c1;
    item_range(item, o0, o1, c0, c1);
    std::vector<ExactPart> ex(static_cast<size_t>(c1 - c0));
    for (int64_t r = 0; r < chunks; ++r)
      for (int64_t c = 0; c < c1 - c0; ++c)
        ex[c] = merged(ex[c], split[(item * chunks + r) * cols + c]);
    write(o0, c0, c1, ex.data());
  }
}

// The mean (per part) and variance of slices from their states: values [slices, size]
// int32, canonical states or digit sums of up to 2**15 of them (every digit in
// [0, 2**31)).  Each field is read as its value modulo 2**(16 length), what `_state.carry`
// makes of it (S1 in two's complement), and rounded as the exact path rounds
// (`exact_result`, with the special values of `_state.values`): the bits of
// `state_moments`.  false (nothing written for the slice) if a digit is negative or
// n S2 < sum S1**2 (not a sum of states).
inline Big field_value(const int32_t* d, int len) {
  Big r;
  for (int i = 0; i < len; ++i) add_shifted(r, static_cast<uint32_t>(d[i]), 16 * i);
  const size_t bits = static_cast<size_t>(16 * len), limbs = (bits + 63) / 64;
  if (r.size() > limbs) r.resize(limbs);
  if (bits % 64 && r.size() == limbs) r[limbs - 1] &= (uint64_t(1) << (bits % 64)) - 1;
  trim(r);
  return r;
}

inline uint64_t count_value(const int32_t* d) {  // a 3-digit field modulo 2**48
  const Big v = field_value(d, 3);
  return v.empty() ? 0 : v[0];
}

template <typename T>
bool state_result(const int32_t* d, const StateLayout& s, int64_t ddof, const Format& f,
                  T* means, T& var) {
  for (int64_t i = 0; i < s.size(); ++i)
    if (d[i] < 0) return false;
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  const uint64_t n = count_value(d);
  const int32_t* at = d + 3;
  bool special = false;
  Big squares;  // sum over the parts of S1**2
  for (int j = 0; j < s.parts; ++j, at += s.l1 + 9) {
    Big v = field_value(at, s.l1);
    const int64_t top = 16 * int64_t(s.l1) - 1;  // the sign bit of the field
    const bool negative = static_cast<int64_t>(v.size()) > top / 64 && bit(v, top);
    if (negative) v = sub(shl(Big{1}, 16 * s.l1), v);
    const uint64_t nans = count_value(at + s.l1), pinf = count_value(at + s.l1 + 3),
                   ninf = count_value(at + s.l1 + 6);
    double mean = n == 0 ? nan : round_ratio(v, negative, f.base(), n, 1, f);
    if (nans || (pinf && ninf)) {
      mean = nan;
    } else if (pinf || ninf) {
      mean = pinf ? inf : -inf;
    }
    means[j] = static_cast<T>(mean);
    special = special || nans || pinf || ninf;
    squares = add(squares, mul(v, v));
  }
  const Big ns = mul(field_value(at, s.l2), Big{n});
  if (cmp(ns, squares) < 0) return false;
  const int64_t dof = static_cast<int64_t>(n) - ddof;
  var = static_cast<T>(special || n == 0 || dof <= 0
                           ? nan
                           : round_ratio(sub(ns, squares), false, 2 * int64_t(f.base()), n,
                                         static_cast<uint64_t>(dof), f));
  return true;
}

// ------------------------------------------------------------------ mean_lo (section 9)
// mean(x) - mean_hi to the format, from a fixed-point sum: the operations of
// moments_core/_kernel.py `mean_lo` (no mask, no padding), one for one.  Every float64
// result below 2**-1022 is flushed to a zero of its sign, as TensorFlow and XLA flush
// on the CPU, so that the bits are those of the XLA kernel and of plain TensorFlow.
inline double ftz(double v) { return std::fabs(v) < 0x1p-1022 ? std::copysign(0.0, v) : v; }

inline double round_to(double v, const Format& f) {  // `_kernel.round_to`
  if (f.precision == 53) return v;
  const double a = std::fabs(v);
  const bool ok = a >= pow2(f.emin) && std::isfinite(a);
  double value = nearest(ok ? a : 1.0, f).c;
  value = ok && value < pow2(f.emax) ? value : (ok ? std::numeric_limits<double>::infinity() : 0.0);
  return v < 0 ? -value : value;
}

// The power of two q of one slice (`_kernel.mean_lo`): every rint(d / q), d = x - mean,
// is an integer and their sum stays below 2**53.  ok false: mean_lo is 0.
struct LoScale {
  double down = 1.0, up = 1.0;  // 1 / q, q
  bool ok = false;
};
inline LoScale lo_scale(double mean, double var, int64_t n, int64_t ddof, const Format& f) {
  const double nf = static_cast<double>(n);
  const double ulp = pow2(std::max(exponent_of(std::fabs(mean)) - (f.precision - 1), -1000));
  const double eff = nf - static_cast<double>(ddof);
  double r2 = ftz(ftz(ftz(ftz(eff * var) * 2.0) + ftz(ftz(nf * ulp) * ulp)) * 2.0);
  LoScale s;
  s.ok = std::isfinite(r2) && std::isfinite(mean) && r2 > 0 && eff > 0;
  if (!s.ok) r2 = 1.0;
  const int half = (exponent_of(r2) + 2) >> 1;  // 2**half >= sqrt(r2)
  int nb = 0;
  for (int64_t m = std::max<int64_t>(n, 1); m; m >>= 1) ++nb;
  const int shift = std::min(std::max(half + nb - 52, -1000), 1000);
  s.down = pow2(-shift);
  s.up = pow2(shift);
  return s;
}

// rint(d / q), d = x - mean, as `_kernel.mean_lo` evaluates it, whose float64 results are
// flushed (ftz).  Two of its flushes cannot change the term here:
// * for float32 data (float16/bfloat16 read as float32) x and mean are float32 values, so
//   d is 0 or at least 2**-149 in magnitude: never below 2**-1022;
// * a product below 2**-1022 rounds to a zero of its sign with or without the flush, and
//   every total starts at +0, to which either zero adds +0.
// float64 data keep the flush of d.
template <typename T>
inline double lo_term(T v, double mean, double down, double tiny) {
  const double d = flushed(v, tiny) - mean;
  if constexpr (std::is_same<T, float>::value) {
    return std::nearbyint(d * down);
  } else {
    return std::nearbyint(ftz(d) * down);
  }
}

// t[i] += lo_term(rows[k][i]) over `rows` rows of `width` columns: a function of its own
// with __restrict operands, which g++ 12 vectorises (inside mean_lo's lambda, with its
// captures, it did not: 5.8 ms for float32 [65536, 64], 3.4x the moments themselves).
template <typename T>
void lo_columns(const T* __restrict x, int64_t rows, int64_t width,
                const double* __restrict mean, const double* __restrict down, double tiny,
                double* __restrict t) {
  for (int64_t k = 0; k < rows; ++k) {
    const T* __restrict row = x + k * width;
    for (int64_t i = 0; i < width; ++i) t[i] += lo_term(row[i], mean[i], down[i], tiny);
  }
}

// x [outer, n, inner] (parts 2: [outer, n, inner, 2]), mean [outer, inner(, 2)] and var
// [outer, inner] as the moments call returned them -> lo, laid out like mean.  Every term
// is an integer and sum |term| < 2**52 (section 9), so every partial sum is exact: the
// terms may be added in any order and any number of chains, and inputs of kThreadMin
// elements or more are cut between `threads` threads (slices, or rows of the columns)
// whose totals are added at the end, with the same bits.
template <typename T>
void mean_lo(const T* x, int64_t outer, int64_t n, int64_t inner, int parts, int64_t ddof,
             const Format& f, const T* mean, const T* var, T* lo, int threads = 1) {
  const int64_t width = inner * parts, slices = outer * width;
  const double tiny = pow2(f.emin);
  std::vector<double> m(slices), down(slices), total(slices, 0.0);
  std::vector<LoScale> scale(slices);
  for (int64_t s = 0; s < slices; ++s) {
    m[s] = static_cast<double>(mean[s]);
    scale[s] = lo_scale(m[s], static_cast<double>(var[s / parts]), n, ddof, f);
    down[s] = scale[s].down;
  }
  const int helpers = outer * n * width >= kThreadMin ? std::max(1, threads) - 1 : 0;
  if (width == 1) {  // contiguous slices (a LayerNormalization): 8 chains per slice
    auto rows = [&](int64_t first, int64_t last) {
      for (int64_t o = first; o < last; ++o) {
        const T* row = x + o * n;
        const double mo = m[o], dn = down[o];
        double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        int64_t k = 0;
        for (; k + 8 <= n; k += 8) {
          for (int j = 0; j < 8; ++j) acc[j] += lo_term(row[k + j], mo, dn, tiny);
        }
        for (; k < n; ++k) acc[0] += lo_term(row[k], mo, dn, tiny);
        total[o] = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
      }
    };
    run_ranges(helpers, outer, rows);
  } else {
    // rows [first, last) of block o added into t (width totals)
    auto block = [&](int64_t o, int64_t first, int64_t last, double* t) {
      lo_columns(x + (o * n + first) * width, last - first, width, m.data() + o * width,
                 down.data() + o * width, tiny, t);
    };
    const int64_t cuts = helpers ? std::min<int64_t>(n, 4 * (helpers + 1)) : 1;
    if (cuts <= 1) {
      for (int64_t o = 0; o < outer; ++o) block(o, 0, n, total.data() + o * width);
    } else {  // every block's rows in `cuts` pieces, each with totals of its own
      std::vector<double> part(static_cast<size_t>(outer * cuts * width), 0.0);
      run_chunks(helpers, outer * cuts, [&](int64_t c, int) {
        const int64_t o = c / cuts, j = c % cuts;
        block(o, j * n / cuts, (j + 1) * n / cuts, part.data() + c * width);
      });
      for (int64_t c = 0; c < outer * cuts; ++c) {
        double* t = total.data() + (c / cuts) * width;
        for (int64_t i = 0; i < width; ++i) t[i] += part[c * width + i];
      }
    }
  }
  const double rn = 1.0 / static_cast<double>(std::max<int64_t>(n, 1));
  for (int64_t s = 0; s < slices; ++s) {
    const double v = ftz(ftz(total[s] * scale[s].up) * rn);
    lo[s] = static_cast<T>(scale[s].ok ? round_to(v, f) : 0.0);
  }
}

// ------------------------------------------------------------------ residuals (the layers)
// r = (x - mean) - mean_lo per element of x [outer, n, inner], mean and mean_lo [outer,
// inner]: the layers' centring (tf_stable_moments/_layer.py `_centre`), in T as TensorFlow
// and XLA evaluate it on the CPU, which flush subnormals: a subnormal operand reads as a
// zero of its sign and a subnormal difference becomes one (whatever this thread's mode).
template <typename T>
inline T flush_subnormal(T v) {
  return std::fabs(v) < std::numeric_limits<T>::min() ? std::copysign(T(0), v) : v;
}

template <typename T>
void residuals(const T* x, int64_t outer, int64_t n, int64_t inner, const T* mean,
               const T* lo, T* r, int threads = 1) {
  std::vector<T> m(static_cast<size_t>(outer * inner)), l(m.size());
  for (size_t s = 0; s < m.size(); ++s) {
    m[s] = flush_subnormal(mean[s]);
    l[s] = flush_subnormal(lo[s]);
  }
  // rows [first, last) of x as [outer * n, inner]: each element on its own, so the rows
  // may be cut between threads (inputs of kThreadMin elements or more) with the same bits
  auto rows = [&](int64_t first, int64_t last) {
    for (int64_t row = first; row < last; ++row) {
      const T* __restrict mo = m.data() + (row / n) * inner;
      const T* __restrict lo_o = l.data() + (row / n) * inner;
      const T* __restrict xr = x + row * inner;
      T* __restrict rr = r + row * inner;
      for (int64_t i = 0; i < inner; ++i) {
        const T d = flush_subnormal(static_cast<T>(flush_subnormal(xr[i]) - mo[i]));
        rr[i] = flush_subnormal(static_cast<T>(d - lo_o[i]));
      }
    }
  };
  const int helpers = outer * n * inner >= kThreadMin ? std::max(1, threads) - 1 : 0;
  run_ranges(helpers, outer * n, rows);
}

// ---- The layers' output formulas (docs section 14): the per-channel factor t ----------
// Used by the TF op StableScaleShift, the TF custom call tf_stable_moments_rsqrt and the
// JAX FFI call StableRsqrt: one definition, the bits of moments_core/_affine.py rsqrt32.

inline uint32_t bits32(float a) {
  uint32_t u;
  std::memcpy(&u, &a, 4);
  return u;
}

inline float from_bits32(uint32_t u) {
  float a;
  std::memcpy(&a, &u, 4);
  return a;
}

// m * m * v < 1 exactly, for m of at most 25 bits and m * m * v within a factor 2 of 1
// (_affine._square_times_below_one): m * m is exact (50 bits), split into h (its leading
// 25 bits) and l (exact), h * v and l * v are exact, h * v - 1 is exact (Sterbenz).
inline bool square_times_below_one(double m, double v) {
  double mm = m * m;
  uint64_t u;
  std::memcpy(&u, &mm, 8);
  u &= ~((uint64_t{1} << 28) - 1);
  double h;
  std::memcpy(&h, &u, 8);
  double l = mm - h;
  return h * v - 1.0 < -(l * v);
}

// RN32(1 / sqrt(v)) (_affine.rsqrt32): a guess from double (relative error far below
// 2**-30, so within one float32 ulp), corrected by the exact tests at the midpoints to its
// neighbours (1 / sqrt(v) is never a midpoint: no ties); v = 0 gives inf, inf gives 0,
// NaN and v < 0 give NaN.
inline float rsqrt32(float v) {
  if (v != v || v < 0.0f) return std::numeric_limits<float>::quiet_NaN();
  double v64 = flush_subnormal(v);  // as TF and JAX read it on the CPU
  float t = static_cast<float>(1.0 / std::sqrt(v64));
  if (!(t > 0.0f && t < INFINITY)) return t;
  float down = from_bits32(bits32(t) - 1), up = from_bits32(bits32(t) + 1);
  double t64 = t;
  double m_down = (static_cast<double>(down) + t64) * 0.5;
  double m_up = (t64 + static_cast<double>(up)) * 0.5;
  if (square_times_below_one(m_up, v64)) return up;
  if (!square_times_below_one(m_down, v64)) return down;
  return t;
}

// The layers' stall test (tf_stable_moments/_advice.py `check`; the TF op
// StableStallCheck and the JAX FFI call stable_stall_check): some channel's float32
// moving mean cannot follow the batch mean, i.e. |mean - moving| * (1 - momentum) is
// below half an ulp of moving and |mean - moving| > threshold * sqrt(var + epsilon).
inline bool any_stalled(const float* moving, const float* mean, const float* var, int64_t n,
                        float momentum, float epsilon, float threshold) {
  const float keep = 1.0f - momentum;
  for (int64_t i = 0; i < n; ++i) {
    const float magnitude = std::fabs(moving[i]);
    const float ulp = std::nextafter(magnitude, INFINITY) - magnitude;
    const float distance = std::fabs(mean[i] - moving[i]);
    const float spread = std::sqrt(var[i] + epsilon);
    if (distance * keep < ulp / 2 && distance > threshold * spread) return true;
  }
  return false;
}

}  // namespace stable_moments

#endif  // TF_STABLE_MOMENTS_NATIVE_MOMENTS_H_
