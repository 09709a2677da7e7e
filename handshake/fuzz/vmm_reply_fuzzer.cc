// libFuzzer entry point: a VMM fd server's reply (data_fuzz_targets.h,
// FuzzVmmReply).
#include "handshake/fuzz/data_fuzz_targets.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  kvferry::handshake::FuzzVmmReply(data, size);
  return 0;
}
