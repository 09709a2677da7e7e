// Batches and their slices in flight. A batch is the caller's list of
// requests; each request is cut into slices, and a slice is what goes on a
// link (a transport work request whose cookie is the slice id). A plain
// container: the batch pipeline's lock guards it (see batch_pipeline.h).
#ifndef KVFERRY_ENGINE_BATCH_TABLE_H_
#define KVFERRY_ENGINE_BATCH_TABLE_H_

#include <cstdint>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/time/time.h"
#include "engine/local_regions.h"
#include "engine/transfer_engine.h"
#include "transport/transport.h"

namespace kvferry {
namespace engine_internal {

struct Slice {
  BatchId batch = 0;
  size_t request = 0;
  SegmentId segment = 0;
  transport::Opcode opcode = transport::Opcode::kWrite;
  void* local = nullptr;
  LocalUse local_use;
  uint64_t remote = 0;
  uint64_t length = 0;
  uint32_t retries_left = 0;
  uint64_t generation = 0;    // of the segment's links it was last posted on
  transport::LinkId link = 0;  // the link it was last posted on (0: none)
  size_t nic = 0;  // that link's local NIC, as an index of the engine's NIC counters
  absl::Status last_error;
};

struct Batch {
  SegmentId segment = 0;
  // The peer instance (engine id) the batch writes to or reads from. A
  // slice is never retried on another instance: its bytes would be split
  // between a dead peer and its successor.
  uint64_t peer_engine_id = 0;
  bool bound = false;   // the caller named the instance
  uint64_t landed = 0;  // slices completed OK
  absl::Time submitted;
  std::vector<transport::Opcode> op;  // per request
  std::vector<uint64_t> length;       // per request
  std::vector<uint64_t> slices_left;  // per request
  std::vector<absl::Status> status;   // first error per request
  size_t pending = 0;                 // requests not finished
  // Empties it for reuse, keeping the vectors' capacity.
  void Reset();
  // The caller's view of it.
  void StatusTo(BatchStatus* out) const;
};

class BatchTable {
 public:
  // A new, empty batch (reusing a released one's vectors when it can).
  BatchId Create(Batch** out);
  Batch* Find(BatchId id);
  // Drops a batch; kept for reuse by Create.
  void Recycle(BatchId id);

  uint64_t AddSlice(const Slice& s);
  Slice* FindSlice(uint64_t id);
  void EraseSlice(uint64_t id) { slices_.erase(id); }

 private:
  static constexpr size_t kSpareBatches = 64;
  absl::flat_hash_map<BatchId, Batch> batches_;
  std::vector<Batch> spare_;
  absl::flat_hash_map<uint64_t, Slice> slices_;
  BatchId last_batch_ = 0;
  uint64_t last_slice_ = 0;
};

}  // namespace engine_internal
}  // namespace kvferry

#endif  // KVFERRY_ENGINE_BATCH_TABLE_H_
