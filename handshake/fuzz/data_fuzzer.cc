// libFuzzer entry point: a TCP data link's stream after its hello
// (data_fuzz_targets.h, FuzzDataStream).
#include "handshake/fuzz/data_fuzz_targets.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  kvferry::handshake::FuzzDataStream(data, size);
  return 0;
}
