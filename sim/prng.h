// Deterministic pseudo-random numbers for the simulator. The same seed gives
// the same sequence on every build and platform: SplitMix64 expands seeds,
// xoshiro256** generates, and every derived quantity (bounded integers,
// chances) uses integer arithmetic only. Never use std::random_device,
// std::*_distribution or absl::BitGen in simulated code.
#ifndef KVFERRY_SIM_PRNG_H_
#define KVFERRY_SIM_PRNG_H_

#include <cstdint>

namespace kvferry {
namespace sim {

// A probability as an exact integer ratio num/den (0 <= num <= den, den > 0).
struct Ratio {
  uint32_t num = 0;
  uint32_t den = 1;
  static Ratio Never() { return {0, 1}; }
  static Ratio Always() { return {1, 1}; }
};

// SplitMix64 (Steele, Lea, Flood 2014); used to expand seeds.
class SplitMix64 {
 public:
  explicit SplitMix64(uint64_t seed) : state_(seed) {}
  uint64_t Next() {
    uint64_t z = (state_ += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  }

 private:
  uint64_t state_;
};

// xoshiro256** (Blackman, Vigna 2018).
class Prng {
 public:
  explicit Prng(uint64_t seed) {
    SplitMix64 sm(seed);
    for (uint64_t& word : s_) word = sm.Next();
  }

  uint64_t Next64() {
    const uint64_t result = Rotl(s_[1] * 5, 7) * 9;
    const uint64_t t = s_[1] << 17;
    s_[2] ^= s_[0];
    s_[3] ^= s_[1];
    s_[1] ^= s_[2];
    s_[0] ^= s_[3];
    s_[2] ^= t;
    s_[3] = Rotl(s_[3], 45);
    return result;
  }

  // Uniform in [0, n) without modulo bias; n must be > 0.
  uint64_t Uniform(uint64_t n) {
    const uint64_t limit = -n % n;  // 2^64 mod n
    uint64_t x;
    do {
      x = Next64();
    } while (x < limit);  // reject the short first bucket
    return x % n;
  }

  // Uniform in [lo, hi] inclusive; requires lo <= hi.
  int64_t UniformIn(int64_t lo, int64_t hi) {
    const uint64_t span = static_cast<uint64_t>(hi) - static_cast<uint64_t>(lo);
    if (span == UINT64_MAX) return static_cast<int64_t>(Next64());
    return static_cast<int64_t>(static_cast<uint64_t>(lo) + Uniform(span + 1));
  }

  // True with probability r.num / r.den. Draws a number only when the ratio
  // is strictly between 0 and 1, so disabled faults consume no randomness.
  bool Chance(Ratio r) {
    if (r.num == 0) return false;
    if (r.num >= r.den) return true;
    return Uniform(r.den) < r.num;
  }

  // A child generator seeded from this one. Components receive their
  // sub-generators in a fixed order so one root seed fixes everything.
  Prng Fork() { return Prng(Next64()); }

 private:
  static uint64_t Rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }
  uint64_t s_[4];
};

}  // namespace sim
}  // namespace kvferry

#endif  // KVFERRY_SIM_PRNG_H_
