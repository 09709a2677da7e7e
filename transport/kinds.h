// The transport kinds: what EndpointDescription::kind says, descriptors
// carry, link parameters begin with, and the engine's path choice
// (engine/pipeline/path_choice.h) compares. Peers' links must be of one kind.
#ifndef KVFERRY_TRANSPORT_KINDS_H_
#define KVFERRY_TRANSPORT_KINDS_H_

namespace kvferry {
namespace transport {
namespace kind {

inline constexpr char kVerbs[] = "verbs";  // transport/verbs: libibverbs RC
inline constexpr char kTcp[] = "tcp";      // transport/tcp: sockets
inline constexpr char kSim[] = "sim";      // transport/sim: the simulated fabric
// transport/cuda_ipc: peers on this host, device memory copied GPU to GPU
inline constexpr char kCudaIpc[] = "cuda_ipc";

}  // namespace kind
}  // namespace transport
}  // namespace kvferry

#endif  // KVFERRY_TRANSPORT_KINDS_H_
