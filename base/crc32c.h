// CRC-32C (Castagnoli), as iSCSI and ext4 use it: the SSE4.2 crc32
// instruction where the CPU has it, a table otherwise (same results).
#ifndef KVFERRY_BASE_CRC32C_H_
#define KVFERRY_BASE_CRC32C_H_

#include <cstddef>
#include <cstdint>

namespace kvferry {

// The CRC-32C of [data, data + n), continuing from `crc` (0 to start).
uint32_t Crc32c(const void* data, size_t n, uint32_t crc = 0);
// The portable version, whatever the CPU (tests compare the two).
uint32_t Crc32cPortable(const void* data, size_t n, uint32_t crc = 0);
// Whether Crc32c uses the CPU's instruction.
bool Crc32cIsHardware();

}  // namespace kvferry

#endif  // KVFERRY_BASE_CRC32C_H_
