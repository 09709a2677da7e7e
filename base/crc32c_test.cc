#include "base/crc32c.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace kvferry {
namespace {

TEST(Crc32c, KnownValues) {
  // The check value of CRC-32C, and RFC 3720's test patterns.
  EXPECT_EQ(Crc32c("123456789", 9), 0xe3069283u);
  EXPECT_EQ(Crc32cPortable("123456789", 9), 0xe3069283u);
  std::vector<unsigned char> zeros(32, 0), ones(32, 0xff), up(32);
  for (int i = 0; i < 32; ++i) up[i] = static_cast<unsigned char>(i);
  EXPECT_EQ(Crc32c(zeros.data(), 32), 0x8a9136aau);
  EXPECT_EQ(Crc32c(ones.data(), 32), 0x62a8ab43u);
  EXPECT_EQ(Crc32c(up.data(), 32), 0x46dd794eu);
  EXPECT_EQ(Crc32c("", 0), 0u);
}

TEST(Crc32c, HardwareAndPortableAgreeAtEveryLengthAndSplit) {
  std::string data(4099, '\0');
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<char>(i * 131 + (i >> 7));
  for (size_t n : {0, 1, 7, 8, 9, 63, 64, 65, 2048, 4099}) {
    const uint32_t whole = Crc32cPortable(data.data(), n);
    EXPECT_EQ(Crc32c(data.data(), n), whole) << n;
    for (size_t cut : {size_t{0}, n / 3, n}) {
      EXPECT_EQ(Crc32c(data.data() + cut, n - cut, Crc32c(data.data(), cut)), whole) << n;
    }
  }
  // One flipped bit changes it.
  std::string flipped = data;
  flipped[1000] ^= 4;
  EXPECT_NE(Crc32c(flipped.data(), flipped.size()), Crc32c(data.data(), data.size()));
}

}  // namespace
}  // namespace kvferry
