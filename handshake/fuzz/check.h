// What a fuzz target does when an invariant breaks: say which, and abort
// (libFuzzer reports the input as a crash).
#ifndef KVFERRY_HANDSHAKE_FUZZ_CHECK_H_
#define KVFERRY_HANDSHAKE_FUZZ_CHECK_H_

#include <cstdio>
#include <cstdlib>

namespace kvferry {
namespace handshake {

inline void Check(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "fuzz: %s\n", what);
    std::abort();
  }
}

}  // namespace handshake
}  // namespace kvferry

#endif  // KVFERRY_HANDSHAKE_FUZZ_CHECK_H_
