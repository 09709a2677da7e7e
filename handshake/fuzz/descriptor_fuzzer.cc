// libFuzzer entry point for descriptor payloads (see fuzz_targets.h):
//   ./bazelw build --config=fuzz //handshake/fuzz:descriptor_fuzzer
//   bazel-bin/handshake/fuzz/descriptor_fuzzer -max_total_time=60 handshake/fuzz/corpus/descriptor
#include "handshake/fuzz/fuzz_targets.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  kvferry::handshake::FuzzDescriptor(data, size);
  return 0;
}
