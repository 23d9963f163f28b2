#pragma once
// The per-element arithmetic of the sampler, written once for sampler_ref (CPU) and the
// CUDA kernel so both compute bit-identical values: float operations without contraction
// (sampler.cu is compiled with -fmad=false; these are single operations on the CPU) and
// the transcendental parts in double.
#include <cmath>
#include <cstdint>

#include "kernels/philox.h"
#include "kernels/sampler.h"

namespace spark::kernels {

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

/// Temperature scaling (t > 0).
SPARK_HD float sample_temper(float z, float t) {
  return z / t;
}

/// Unnormalised probability of z when the row's largest value is zmax.
SPARK_HD double sample_mass(float z, float zmax) {
  return exp(static_cast<double>(z) - static_cast<double>(zmax));
}

/// Whether z survives top-k (z >= k_floor), top-p (z >= p_floor) and min-p.
SPARK_HD bool sample_keep(float z, float zmax, float k_floor, float p_floor, float min_p) {
  if (!(z >= k_floor) || !(z >= p_floor)) return false;
  return min_p <= 0.0f || sample_mass(z, zmax) >= static_cast<double>(min_p);
}

/// Gumbel-perturbed score of token i: the draw is the argmax of this over the kept set.
SPARK_HD double sample_score(float z, const SampleParams& p, uint32_t i) {
  const double u = philox_uniform(p.seed, p.request, p.step, i);
  return static_cast<double>(z) - log(-log(u));
}

}  // namespace spark::kernels
