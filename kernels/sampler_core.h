#pragma once
// The per-element arithmetic and the selection steps of the sampler, written once for
// sampler_ref (CPU) and the CUDA kernels so both compute bit-identical values and make the
// same decisions:
// - float operations are single roundings (sampler.cu is compiled with -fmad=false; here
//   each is one operation, and every multiply-add is an explicit fma);
// - probability mass is an integer, 2^32 * exp(z - zmax) rounded down, from an exp of our
//   own made of fma and ldexp only (no libm, whose last bit differs between the CPU and
//   CUDA; the Gumbel score's logs likewise, sample_log). Sums of masses are then exact in any
//   order, so a device that adds them in per-block, per-bin partials gets the twin's totals, and
//   the top-p and min-p decisions compare those integers (converted to double, one rounding) the
//   same way on both sides;
// - the device's pre-filter (a histogram over bins of zmax - z, see sample_plan) only
//   chooses which tokens reach the exact selection; it never changes the result.
#include <cfloat>
#include <cmath>
#include <cstdint>

#include "kernels/philox.h"
#include "kernels/sampler.h"

namespace spark::kernels {

/// Mass of the largest value: 2^32 (so a row of vocab v sums to at most v * 2^32).
inline constexpr uint64_t kSampleMassOne = uint64_t{1} << 32;
/// Histogram bins of the device's pre-filter: 16 per nat of zmax - z, the last one for
/// everything 32 nats or more below the top (their mass is 0: exp(-23) * 2^32 < 1).
inline constexpr int kSampleBins = 512;
inline constexpr float kSampleBinsPerNat = 16.0f;

/// The device workspace (sampler.cu): per row a header of histograms and counters, one
/// partial result per block (a block covers at least kSampleMinChunk tokens), then the
/// tempered logits, the candidate ids and the top-alternative candidate ids (vocab each).
inline constexpr size_t kSampleHeadBytes = 8704;
inline constexpr size_t kSamplePartialBytes = 64;
inline constexpr int kSampleMinChunk = 2048;

/// Repetition, presence and frequency penalties on one logit.
SPARK_HD float sample_penalize(float l, const SampleParams& p, uint8_t seen, int32_t count) {
  if (seen && p.repetition_penalty != 1.0f)
    l = l > 0 ? l / p.repetition_penalty : l * p.repetition_penalty;
  if (count > 0) {
    // One rounding for the penalty (an explicit fma), so no compiler contracts it otherwise.
    l = l - fmaf(p.frequency_penalty, static_cast<float>(count), p.presence_penalty);
  }
  return l;
}

/// Whether the mask (structured outputs; null: none) allows id i.
SPARK_HD bool sample_allowed(const uint32_t* mask, int i) {
  return !mask || ((mask[i >> 5] >> (i & 31)) & 1u) != 0;
}

/// A value (penalised; tempered unless greedy) under the row's mask: -inf for an excluded
/// id; an allowed id's at least -FLT_MAX, so that one whose logit is -inf still outranks
/// every excluded id. Without a mask, v itself.
SPARK_HD float sample_masked(float v, const uint32_t* mask, int i) {
  if (!mask) return v;
  if (!sample_allowed(mask, i)) return -INFINITY;
  return v < -FLT_MAX ? -FLT_MAX : v;
}

/// Temperature scaling (t > 0).
SPARK_HD float sample_temper(float z, float t) {
  return z / t;
}

/// floor(2^32 * exp(z - zmax)) for z <= zmax, the integer probability mass: exactly 2^32
/// where z == zmax (infinities included), 0 below zmax - 23 and for NaN. exp by range
/// reduction to |r| <= ln2/2 and a degree-11 Taylor polynomial (relative error < 1e-15,
/// far below the 2^-32 step), in fma and ldexp only, which round the same everywhere.
SPARK_HD uint64_t sample_mass_q(float z, float zmax) {
  if (z == zmax) return kSampleMassOne;
  const float d = z - zmax;
  if (!(d > -23.0f)) return 0;
  const double x = static_cast<double>(d);
  const double n = floor(fma(x, 1.4426950408889634, 0.5));
  double r = fma(-n, 6.93147180369123816490e-01, x);  // ln2, high part (exact product)
  r = fma(-n, 1.90821492927058770002e-10, r);         // ln2, low part
  double q = 1.0 / 39916800.0;
  q = fma(q, r, 1.0 / 3628800.0);
  q = fma(q, r, 1.0 / 362880.0);
  q = fma(q, r, 1.0 / 40320.0);
  q = fma(q, r, 1.0 / 5040.0);
  q = fma(q, r, 1.0 / 720.0);
  q = fma(q, r, 1.0 / 120.0);
  q = fma(q, r, 1.0 / 24.0);
  q = fma(q, r, 1.0 / 6.0);
  q = fma(q, r, 0.5);
  q = fma(q, r, 1.0);
  q = fma(q, r, 1.0);
  const double m = ldexp(q, static_cast<int>(n) + 32);
  return m >= static_cast<double>(kSampleMassOne) ? kSampleMassOne - 1 : static_cast<uint64_t>(m);
}

/// Whether z survives top-k (z >= k_floor), top-p (z >= p_floor) and min-p (its mass at
/// least min_p times the top one's).
SPARK_HD bool sample_keep(float z, float zmax, float k_floor, float p_floor, float min_p) {
  if (!(z >= k_floor) || !(z >= p_floor)) return false;
  return min_p <= 0.0f || static_cast<double>(sample_mass_q(z, zmax)) >=
                              static_cast<double>(min_p) * static_cast<double>(kSampleMassOne);
}

/// log(x) for finite x > 0 in frexp, one division and fma only (so the CPU and CUDA get
/// the same bits; libm's log and CUDA's differ in the last one): x = m 2^e with m in
/// [sqrt(1/2), sqrt(2)), log m = 2 atanh(s), s = (m - 1) / (m + 1), |s| < 0.172, by a
/// series to s^21 (relative error ~1e-16).
SPARK_HD double sample_log(double x) {
  int e = 0;
  double m = frexp(x, &e);
  if (m < 0.70710678118654752440) m = m * 2.0, e -= 1;
  const double f = m - 1.0;  // exact
  const double s = f / (2.0 + f);
  const double s2 = s * s;
  double q = 1.0 / 21.0;
  q = fma(q, s2, 1.0 / 19.0);
  q = fma(q, s2, 1.0 / 17.0);
  q = fma(q, s2, 1.0 / 15.0);
  q = fma(q, s2, 1.0 / 13.0);
  q = fma(q, s2, 1.0 / 11.0);
  q = fma(q, s2, 1.0 / 9.0);
  q = fma(q, s2, 1.0 / 7.0);
  q = fma(q, s2, 1.0 / 5.0);
  q = fma(q, s2, 1.0 / 3.0);
  const double two_s = 2.0 * s;
  const double lm = fma(two_s, s2 * q, two_s);
  const double de = static_cast<double>(e);
  return fma(de, 6.93147180369123816490e-01, fma(de, 1.90821492927058770002e-10, lm));
}

/// Gumbel-perturbed score of token i: the draw is the argmax of this over the kept set.
SPARK_HD double sample_score(float z, const SampleParams& p, uint32_t i) {
  const double u = philox_uniform(p.seed, p.request, p.step, i);
  return static_cast<double>(z) - sample_log(-sample_log(u));
}

/// Whether top-k / top-p are on for this row.
SPARK_HD bool sample_has_k(const SampleParams& p, int vocab) {
  return p.top_k > 0 && p.top_k < vocab;
}
SPARK_HD bool sample_has_p(const SampleParams& p) {
  return p.top_p < 1.0f;
}

/// The pre-filter's bin of z: 0 for the top value, then 16 per nat below it, the last bin
/// for 32 nats or more (and -inf, NaN). Non-decreasing as z decreases, so a bin boundary
/// never splits equal values and every value above a bin's tokens lies in a lower bin.
SPARK_HD int sample_bin(float z, float zmax) {
  if (z == zmax) return 0;
  const float d = (zmax - z) * kSampleBinsPerNat;
  if (!(d < static_cast<float>(kSampleBins - 1))) return kSampleBins - 1;
  return d > 0.0f ? static_cast<int>(d) : 0;
}

/// What the histogram of a row decides: tokens in bins below b0 are kept without
/// comparison (min-p still applies), bins b0..b1 hold the candidates that the exact
/// selection sorts, tokens above b1 cannot be kept. prefix_* are the bins below b0.
struct SamplePlan {
  int32_t b0 = kSampleBins, b1 = -1;
  uint32_t prefix_count = 0;
  uint64_t prefix_mass = 0;
  uint64_t total = 0;  // the row's whole mass (pure top-p)
};

/// The plan from a row's histogram (count[b] tokens and mass[b] of their masses per bin;
/// mass is read only for top-p without top-k):
/// - neither top-k nor top-p: every token is decided alone (b0 past the last bin);
/// - top-k (with or without top-p): candidates are the bins up to the one where the count
///   reaches top_k: the top-k set, and the top-p set inside it, lie there;
/// - top-p alone: the bin where the mass from the top reaches top_p of the total holds the
///   floor; the bins above it are kept whole, it alone is sorted.
SPARK_HD SamplePlan sample_plan(const SampleParams& p, int vocab, const uint32_t* count,
                                const uint64_t* mass) {
  SamplePlan pl;
  if (sample_has_k(p, vocab)) {
    pl.b0 = 0;
    uint64_t cum = 0;
    pl.b1 = kSampleBins - 1;
    for (int b = 0; b < kSampleBins; ++b) {
      cum += count[b];
      if (cum >= static_cast<uint64_t>(p.top_k)) {
        pl.b1 = b;
        break;
      }
    }
  } else if (sample_has_p(p)) {
    for (int b = 0; b < kSampleBins; ++b) pl.total += mass[b];
    const double target = static_cast<double>(p.top_p) * static_cast<double>(pl.total);
    uint64_t cum = 0, n = 0;
    int pick = kSampleBins - 1;
    for (int b = 0; b < kSampleBins; ++b) {
      if (static_cast<double>(cum + mass[b]) >= target) {
        pick = b;
        break;
      }
      cum += mass[b];
      n += count[b];
    }
    pl.b0 = pl.b1 = pick;
    pl.prefix_mass = cum;
    pl.prefix_count = static_cast<uint32_t>(n);
  }
  return pl;
}

/// The first bin from the top whose cumulative count reaches k (the top-k alternatives
/// of the raw logits lie in bins up to it).
SPARK_HD int sample_top_bin(const uint32_t* count, int k) {
  uint64_t cum = 0;
  for (int b = 0; b < kSampleBins; ++b) {
    cum += count[b];
    if (cum >= static_cast<uint64_t>(k)) return b;
  }
  return kSampleBins - 1;
}

struct SampleFloors {
  float k_floor = -INFINITY, p_floor = -INFINITY;
};

/// The top-k and top-p floors from the plan's n candidates sorted by value, largest first
/// (zat(j): the j-th value; mat(j): its mass, read only for top-p). Top-k: the top_k-th
/// value (ties all kept). Top-p over the top-k set: the first value from the top at which
/// the cumulative mass reaches top_p of the set's total (the bins above b0 counted in).
template <class ZAt, class MAt>
SPARK_HD SampleFloors sample_floors(const SampleParams& p, int vocab, const SamplePlan& pl, int n,
                                    ZAt zat, MAt mat) {
  SampleFloors f;
  if (n <= 0) return f;
  const bool has_k = sample_has_k(p, vocab);
  if (has_k) {
    const int64_t at = static_cast<int64_t>(p.top_k) - 1 - pl.prefix_count;
    f.k_floor = zat(static_cast<int>(at < 0 ? 0 : (at >= n ? n - 1 : at)));
  }
  if (sample_has_p(p)) {
    uint64_t total = pl.total, cum = pl.prefix_mass;
    if (has_k) {
      total = 0;
      for (int j = 0; j < n && zat(j) >= f.k_floor; ++j) total += mat(j);
      cum = 0;
    }
    const double target = static_cast<double>(p.top_p) * static_cast<double>(total);
    for (int j = 0; j < n; ++j) {
      const float v = zat(j);
      if (has_k && !(v >= f.k_floor)) break;
      f.p_floor = v;  // the smallest walked so far: the floor if rounding never reaches it
      cum += mat(j);
      if (static_cast<double>(cum) >= target) break;
    }
  }
  return f;
}

}  // namespace spark::kernels
