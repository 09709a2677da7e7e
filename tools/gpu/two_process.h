// What the GPU check (gpu_check.cc) and the two-process CUDA IPC test
// (tests/cuda_ipc_test.cc) share: an engine over TCP on loopback, and the
// line protocol between their processes.
#ifndef KVFERRY_TOOLS_GPU_TWO_PROCESS_H_
#define KVFERRY_TOOLS_GPU_TWO_PROCESS_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "engine/transfer_engine.h"

namespace kvferry {
namespace gpu {

// An engine on 127.0.0.1 over the TCP transport (sockets, never the
// in-process shortcut), with the same-host cuda_ipc transport beside it or
// not (then device memory goes staged over TCP), `links` links per peer
// and slices of `slice_bytes`; null if it cannot start.
std::unique_ptr<TransferEngine> LoopbackEngine(bool cuda_ipc, uint32_t links = 2,
                                               uint64_t slice_bytes = 64 << 10);

// FNV-1a of the bytes (to compare buffers across processes).
uint64_t Fnv(const std::vector<char>& bytes);

// One line from `fd` without its newline ("" at EOF); one line to `fd`.
std::string ReadLine(int fd);
void WriteLine(int fd, const std::string& line);

}  // namespace gpu
}  // namespace kvferry

#endif  // KVFERRY_TOOLS_GPU_TWO_PROCESS_H_
