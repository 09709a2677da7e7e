// libFuzzer entry point for handshake frames (see fuzz_targets.h):
//   ./bazelw build --config=fuzz //handshake/fuzz:frame_fuzzer
//   bazel-bin/handshake/fuzz/frame_fuzzer -max_total_time=60 handshake/fuzz/corpus/frame
#include "handshake/fuzz/fuzz_targets.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  kvferry::handshake::FuzzFrame(data, size);
  return 0;
}
