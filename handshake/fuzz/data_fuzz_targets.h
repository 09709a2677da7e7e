// Fuzz targets for what a peer sends outside the handshake: the TCP data
// stream after a valid hello (data headers, payloads, error texts), and a
// VMM fd server's reply. Callable from libFuzzer entry points
// (data_fuzzer.cc, vmm_reply_fuzzer.cc) and from the corpus test.
#ifndef KVFERRY_HANDSHAKE_FUZZ_DATA_FUZZ_TARGETS_H_
#define KVFERRY_HANDSHAKE_FUZZ_DATA_FUZZ_TARGETS_H_

#include <cstddef>
#include <cstdint>

namespace kvferry {
namespace handshake {

// The bytes, as a peer's data connection of one established link of a
// real TCP transport (loopback) sends them after its hello. The 8-byte
// placeholders "RKEY____" and "ADDR____" in the input become the key and
// the address of a registered writable region, "ROKEY___" and "ROADDR__"
// those of a read-only one, so that mutations reach the responder's
// checks and copies. Aborts if a byte outside the writable region, or of
// the read-only one, changes.
void FuzzDataStream(const uint8_t* data, size_t size);
// The bytes as a VMM server's reply to a fetch (transport::ReadVmmReply).
// Aborts if it accepts a reply (none carries descriptors here).
void FuzzVmmReply(const uint8_t* data, size_t size);
// The bytes as a request to this process's VMM server, which exports
// nothing. Aborts if it ever answers with chunks, or stops answering.
void FuzzVmmRequest(const uint8_t* data, size_t size);

}  // namespace handshake
}  // namespace kvferry

#endif  // KVFERRY_HANDSHAKE_FUZZ_DATA_FUZZ_TARGETS_H_
