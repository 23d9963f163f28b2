#pragma once
// The q/k/v-with-RoPE epilogue cases of the GPU tests (bf16 and FP8 products alike): the
// outputs a case writes (q, k and v rows of m tokens, K and V pools of 64 cache slots, all
// poisoned), its random positions and slots (row 1 a padding row, row 2 past the pool), the
// RopeArgs over them, and the check that the fused launch wrote the bits of the products
// followed by the RoPE kernel, everywhere and only where it should.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "kernels/launch.h"
#include "kernels/rope.h"
#include "support/gpu_values.h"

namespace spark::test::gpu {

class QkvRopeIo {
 public:
  struct Out {
    Dev y[3], kc, vc;
  };
  static constexpr int kSlots = 64;

  QkvRopeIo(std::mt19937& rng, int nh, int nkv, int hd, size_t m, DType t, DType ct)
      : nh_(nh), nkv_(nkv), hd_(hd), m_(m), t_(t), ct_(ct) {
    width[0] = static_cast<size_t>(nh * hd);
    width[1] = width[2] = static_cast<size_t>(nkv * hd);
    std::vector<int32_t> pos(m);
    for (auto& x : pos) x = std::uniform_int_distribution<int32_t>(0, 32767)(rng);
    std::vector<int32_t> perm(kSlots);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    slot_.resize(m);
    for (size_t i = 0; i < m; ++i) slot_[i] = perm[i];
    if (m > 1) slot_[1] = -1;      // a padding row: no cache write
    if (m > 2) slot_[2] = kSlots;  // past the pool: skipped
    dpos_ = ints_to_dev(pos), dslot_ = ints_to_dev(slot_);
    dinv_ = DeviceBuf<float>::from(rope_inv_freq(hd, 500000.0, {}));
    dqn_ = to_dev(as_stored(randoms(rng, static_cast<size_t>(hd), 0.5f, 1.5f), t), t);
    dkn_ = to_dev(as_stored(randoms(rng, static_cast<size_t>(hd), 0.5f, 1.5f), t), t);
  }

  size_t width[3];

  Out fresh() const {
    Out o;
    for (int i = 0; i < 3; ++i) o.y[i] = poisoned(m_ * width[i], t_);
    o.kc = poisoned(kSlots * width[1], ct_), o.vc = poisoned(kSlots * width[1], ct_);
    return o;
  }

  RopeArgs rope_for(Out& o, bool q_norm, bool k_norm) const {
    RopeArgs r;
    r.dtype = t_, r.q = o.y[0].get(), r.q_stride = width[0], r.n_heads = nh_;
    r.k = o.y[1].get(), r.k_stride = width[1], r.n_kv_heads = nkv_, r.head_dim = hd_;
    r.n_tokens = m_, r.positions = dpos_.get(), r.inv_freq = dinv_.get();
    r.q_norm = q_norm ? dqn_.get() : nullptr, r.k_norm = k_norm ? dkn_.get() : nullptr;
    r.k_cache = o.kc.get(), r.v_cache = o.vc.get(), r.cache_dtype = ct_;
    r.cache_slots = kSlots, r.slots = dslot_.get(), r.v = o.y[2].get(), r.v_stride = width[2];
    return r;
  }

  // The products (fill's arguments, plain's launch) then the RoPE kernel into one set of
  // outputs, the fused launch (under programmatic launch when pdl) into another, and
  // check_same of the two.
  template <typename Args, typename Fill, typename Plain, typename Fused>
  void compare(bool pdl, bool q_norm, bool k_norm, Fill fill, Plain plain, Fused fused) const {
    Out ref = fresh(), got = fresh();
    Args a[3];
    fill(ref, a);
    REQUIRE(plain(a).ok());
    REQUIRE(rope_cuda_device(rope_for(ref, q_norm, k_norm), nullptr).ok());
    fill(got, a);
    set_programmatic_launch(pdl);
    auto st = fused(a, rope_for(got, q_norm, k_norm));
    set_programmatic_launch(false);
    REQUIRE_MESSAGE(st.ok(), st.message());
    REQUIRE(cuda_synchronize().ok());
    check_same(ref, got);
  }

  // got holds ref's bits in every output and cache row, every output was written, and the
  // cache holds exactly the rows of the slots in the pool.
  void check_same(const Out& ref, const Out& got) const {
    auto same = [](const Dev& x, const Dev& y) {
      const auto u = from_dev(x), v = from_dev(y);
      return u.size() == v.size() && std::memcmp(u.data(), v.data(), u.size() * 4) == 0;
    };
    CHECK(same(ref.y[0], got.y[0]));
    CHECK(same(ref.y[1], got.y[1]));
    CHECK(same(ref.y[2], got.y[2]));
    CHECK(same(ref.kc, got.kc));
    CHECK(same(ref.vc, got.vc));
    size_t unwritten = 0;
    for (int i = 0; i < 3; ++i)
      for (float v : from_dev(got.y[i])) unwritten += std::isnan(v) ? 1 : 0;
    CHECK(unwritten == 0);
    size_t cached = 0, want = 0;
    for (float v : from_dev(got.kc)) cached += std::isnan(v) ? 0 : 1;
    for (int32_t sl : slot_) want += sl >= 0 && sl < kSlots ? width[1] : 0;
    CHECK(cached == want);
  }

 private:
  int nh_, nkv_, hd_;
  size_t m_;
  DType t_, ct_;
  std::vector<int32_t> slot_;
  DeviceBuf<int32_t> dpos_, dslot_;
  DeviceBuf<float> dinv_;
  Dev dqn_, dkn_;
};

}  // namespace spark::test::gpu
