// libFuzzer entry point: a TCP data connection's first bytes
// (fuzz_targets.h, FuzzHello).
#include "handshake/fuzz/fuzz_targets.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  kvferry::handshake::FuzzHello(data, size);
  return 0;
}
