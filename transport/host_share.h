// HostShare: memory a process lets the peers on its host copy from and into
// themselves, named by a small reference instead of sent as bytes. A stream
// transport (transport/tcp) carries the references and the answers; an
// implementation of this interface makes and opens them
// (transport/cuda_ipc: CUDA IPC handles and VMM fds, copied GPU to GPU).
// The stream transport knows nothing of what a reference means, and the
// implementation nothing of links, keys or the wire.
//
// The flow of one request whose local buffer is shared (the requester
// named it; the responder copies):
//   registration  Share(addr, length, device)    -> Export (kept with the region)
//   requester     Name(export, offset, peer word) -> ShareRef on the wire
//   responder     Copy(imports, ref, ...)         between its region and the ref
// The responder checks the request's key, range and access as for any
// request before Copy runs: a reference only says where the requester's
// bytes are. A Copy that cannot run here (the driver cannot open the
// reference) returns an error other than kInvalidArgument, and the
// requester sends the request again with its bytes.
//
// LIFESPAN AND OWNERSHIP. The transport holds the HostShare (shared) for as
// long as it lives. An Export lives as long as its region's registration:
// destroying it withdraws the region from peers. An Imports belongs to one
// link's responder side (its reader thread alone uses it) and closes what it
// opened when destroyed.
//
// THREADS. Share, Name and NewImports may be called from any thread at
// once; Copy is called by one thread per Imports.
#ifndef KVFERRY_TRANSPORT_HOST_SHARE_H_
#define KVFERRY_TRANSPORT_HOST_SHARE_H_

#include <cstdint>
#include <memory>

#include "absl/status/status.h"

namespace kvferry {
namespace transport {

// A reference, as it crosses the wire (72 bytes, host byte order). Which of
// an implementation's two kinds it is travels beside it (`second_kind`
// below; a header flag on the TCP wire).
struct ShareRef {
  uint8_t bytes[64] = {};  // what the implementation needs to open the memory
  uint64_t offset = 0;     // of the request's bytes in what `bytes` opens
};
static_assert(sizeof(ShareRef) == 72, "a reference's wire size");

class HostShare {
 public:
  // What a registration gave peers; opaque to the transport.
  class Export {
   public:
    virtual ~Export() = default;
  };
  // One link's opened references, responder side.
  class Imports {
   public:
    virtual ~Imports() = default;
  };

  virtual ~HostShare() = default;

  // The word this process's links advertise to peers on its host (for
  // example the name of a server they fetch memory from); 0: none.
  virtual uint64_t LinkWord() const = 0;
  // What lets peers on this host copy [addr, +length) of CUDA device
  // `device` (-1: host memory) themselves; null when they cannot (the
  // memory then goes as bytes).
  virtual std::unique_ptr<Export> Share(void* addr, uint64_t length, int device) = 0;
  // Names the bytes from `offset` in the region `exp` was made for, for a
  // peer whose link word is `peer_word` (*second_kind: which kind of
  // reference); false when that peer cannot open them (the request then
  // carries its bytes).
  virtual bool Name(const Export& exp, uint64_t offset, uint64_t peer_word, ShareRef* ref,
                    bool* second_kind) const = 0;
  // A link's responder-side table of opened references, for a peer whose
  // link word is `peer_word`.
  virtual std::unique_ptr<Imports> NewImports(uint64_t peer_word) = 0;
  // Copies `length` bytes between `target` (this process's memory, on CUDA
  // device `device` or -1 for host memory) and the requester's memory `ref`
  // names (of the kind `second_kind` says): into `target` when `write`, out
  // of it otherwise. OK once every
  // byte is in place; kInvalidArgument for a reference that is wrong (past
  // its allocation): the request is refused; any other error: not served
  // here, the requester sends its bytes instead.
  virtual absl::Status Copy(Imports& imports, const ShareRef& ref, bool second_kind, bool write,
                            char* target, int device, uint64_t length) = 0;
};

}  // namespace transport
}  // namespace kvferry

#endif  // KVFERRY_TRANSPORT_HOST_SHARE_H_
