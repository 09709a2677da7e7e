// libFuzzer entry point: frames from anyone to an engine with a secret
// (fuzz_targets.h, FuzzAuthenticated).
#include "handshake/fuzz/fuzz_targets.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  kvferry::handshake::FuzzAuthenticated(data, size);
  return 0;
}
