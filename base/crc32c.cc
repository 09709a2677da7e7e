#include "base/crc32c.h"

#include <array>
#include <cstring>

namespace kvferry {
namespace {

constexpr uint32_t kPoly = 0x82f63b78;  // reflected Castagnoli polynomial

struct Table {
  std::array<std::array<uint32_t, 256>, 8> t{};
  constexpr Table() {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (c & 1 ? kPoly : 0);
      t[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; ++i) {
      for (int s = 1; s < 8; ++s) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xff];
    }
  }
};
constexpr Table kTable;

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) uint32_t Hardware(const unsigned char* p, size_t n,
                                                     uint32_t crc) {
  uint64_t c = ~crc;
  for (; n >= 8; n -= 8, p += 8) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    c = __builtin_ia32_crc32di(c, v);
  }
  uint32_t c32 = static_cast<uint32_t>(c);
  for (; n > 0; --n, ++p) c32 = __builtin_ia32_crc32qi(c32, *p);
  return ~c32;
}

bool HasSse42() {
  static const bool has = __builtin_cpu_supports("sse4.2");
  return has;
}
#endif

}  // namespace

uint32_t Crc32cPortable(const void* data, size_t n, uint32_t crc) {
  const unsigned char* p = static_cast<const unsigned char*>(data);
  uint32_t c = ~crc;
  // Slicing by 8 (little-endian loads).
  for (; n >= 8; n -= 8, p += 8) {
    const uint32_t lo = c ^ (uint32_t{p[0]} | uint32_t{p[1]} << 8 | uint32_t{p[2]} << 16 |
                             uint32_t{p[3]} << 24);
    c = kTable.t[7][lo & 0xff] ^ kTable.t[6][(lo >> 8) & 0xff] ^ kTable.t[5][(lo >> 16) & 0xff] ^
        kTable.t[4][lo >> 24] ^ kTable.t[3][p[4]] ^ kTable.t[2][p[5]] ^ kTable.t[1][p[6]] ^
        kTable.t[0][p[7]];
  }
  for (; n > 0; --n, ++p) c = (c >> 8) ^ kTable.t[0][(c ^ *p) & 0xff];
  return ~c;
}

uint32_t Crc32c(const void* data, size_t n, uint32_t crc) {
#if defined(__x86_64__)
  if (HasSse42()) return Hardware(static_cast<const unsigned char*>(data), n, crc);
#endif
  return Crc32cPortable(data, n, crc);
}

bool Crc32cIsHardware() {
#if defined(__x86_64__)
  return HasSse42();
#else
  return false;
#endif
}

}  // namespace kvferry
