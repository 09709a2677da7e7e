// What the handshake fuzzers exercise, callable from a libFuzzer entry
// point (frame_fuzzer.cc, descriptor_fuzzer.cc) and from the corpus test
// that replays every seed and every past crash in the normal build.
//
// Both abort (so the fuzzer reports a crash) when a decoder accepts bytes
// whose re-encoding does not decode to the same value, besides whatever
// the sanitizers find.
#ifndef KVFERRY_HANDSHAKE_FUZZ_FUZZ_TARGETS_H_
#define KVFERRY_HANDSHAKE_FUZZ_FUZZ_TARGETS_H_

#include <cstddef>
#include <cstdint>

namespace kvferry {
namespace handshake {

// A frame as a peer would send it: header, then the payload decoded with
// the decoder its type selects.
void FuzzFrame(const uint8_t* data, size_t size);
// A descriptor payload: decode, re-encode, decode again, compare.
void FuzzDescriptor(const uint8_t* data, size_t size);
// What an engine with a secret does with a frame from anyone (its first
// byte the type, the rest the payload): the authenticated server's checks
// (challenge, envelope, tag, nonce, decryption). Aborts if a frame nobody
// with the secret made ever reaches the engine's own handler.
void FuzzAuthenticated(const uint8_t* data, size_t size);
// A data connection's first bytes, checked as the TCP data port does
// (transport::CheckHello) with and without a secret. Aborts if it accepts
// bytes that are not exactly the hello EncodeHello makes for their token.
void FuzzHello(const uint8_t* data, size_t size);

}  // namespace handshake
}  // namespace kvferry

#endif  // KVFERRY_HANDSHAKE_FUZZ_FUZZ_TARGETS_H_
