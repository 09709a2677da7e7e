// libFuzzer entry point: a request to this process's VMM fd server
// (data_fuzz_targets.h, FuzzVmmRequest).
#include "handshake/fuzz/data_fuzz_targets.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  kvferry::handshake::FuzzVmmRequest(data, size);
  return 0;
}
