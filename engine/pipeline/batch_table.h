// Batches and their slices in flight. A batch is the caller's list of
// requests; each request is cut into slices, and a slice is what goes on a
// link (a transport work request whose cookie is the slice id). A plain
// container: each of the batch pipeline's lanes holds one, under the
// lane's lock (see lanes.h).
#ifndef KVFERRY_ENGINE_PIPELINE_BATCH_TABLE_H_
#define KVFERRY_ENGINE_PIPELINE_BATCH_TABLE_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "engine/memory/local_regions.h"
#include "engine/types.h"
#include "transport/transport.h"

namespace kvferry {
namespace engine_internal {

struct Slice {
  // (Fields ordered so that the struct packs: a prepared transfer copies
  // one per descriptor on each post.)
  BatchId batch = 0;
  // A part of request `request`, or (`requests` > 1) requests [request,
  // request + requests) whole: adjacent requests whose bytes follow each
  // other on both ends travel as one slice (see PlanSlices).
  size_t request = 0;
  uint32_t requests = 1;
  uint32_t retries_left = 0;
  SegmentId segment = 0;
  void* local = nullptr;
  LocalUse local_use;
  uint64_t remote = 0;
  uint64_t length = 0;
  // The peer region it lies in, an index of the segment's descriptor, valid
  // while the segment's generation + 1 is `checked` (0: not checked).
  uint64_t checked = 0;
  uint32_t region = 0;
  transport::NicIndex nic = 0;  // its link's local NIC, as an index of the engine's NIC counters
  uint64_t generation = 0;      // of the segment's links it was last posted on
  transport::LinkId link = 0;   // the link it was last posted on (0: none)
  absl::Status last_error;
  transport::Opcode opcode = transport::Opcode::kWrite;
};

// What a batch is bound to (TransferEngine::Submit): the peer instance its
// addresses came from (0: any), and this engine's epoch with that peer
// then (none: any; see SegmentCore::epoch).
struct PeerBinding {
  uint64_t engine_id = 0;
  std::optional<uint64_t> epoch;
  // Tell Lanes' FinishedBatches hook when the batch finishes (a prepared
  // transfer's notification goes out then, whether or not anyone polls).
  bool announce = false;
};

struct Batch {
  SegmentId segment = 0;
  // The peer instance (engine id) the batch writes to or reads from. A
  // slice is never retried on another instance: its bytes would be split
  // between a dead peer and its successor.
  uint64_t peer_engine_id = 0;
  bool bound = false;     // the caller named the instance
  bool announce = false;  // PeerBinding::announce
  // The segment's epoch when the batch was made (SegmentCore::epoch): a
  // peer that fenced this engine took everything of that epoch as lost,
  // and none of it goes to the peer at a later one.
  uint64_t epoch = 0;
  uint64_t landed = 0;  // slices completed OK
  absl::Time submitted;
  // One of the batch's requests.
  struct Request {
    transport::Opcode op = transport::Opcode::kWrite;
    uint64_t length = 0;
    uint64_t slices_left = 0;
    absl::Status status;  // its first error
  };
  std::vector<Request> requests;
  size_t pending = 0;  // requests not finished
  // Empties it for reuse, keeping the vectors' capacity.
  void Reset();
  // The caller's view of it.
  void StatusTo(BatchStatus* out) const;
};

// Batches and slices live in slabs: an id is a slot index and the slot's
// generation, so a lookup is an index and a compare (no hashing), a released
// id is not confused with its slot's next user (until the slot's 2^24th
// reuse), and a recycled batch keeps its vectors' capacity. The id's top
// byte is the table's tag (the pipeline's lane that holds it, see lanes.h).
// Pointers stay valid until the next Create or AddSlice.
class BatchTable {
 public:
  static constexpr int kTagShift = 56;
  static constexpr uint64_t kGenerationMask = (uint64_t{1} << 24) - 1;
  explicit BatchTable(uint8_t tag = 0) : batches_(tag), slices_(tag) {}
  // The tag of an id this table (or another with the tag) gave.
  static uint8_t TagOf(uint64_t id) { return static_cast<uint8_t>(id >> kTagShift); }

  // A new, empty batch (reusing a released one's vectors when it can).
  BatchId Create(Batch** out) { return batches_.Take(out); }
  Batch* Find(BatchId id) { return batches_.Find(id); }
  // Drops a batch; its slot is reused by Create.
  void Recycle(BatchId id) {
    if (Batch* b = batches_.Find(id)) {
      b->Reset();
      batches_.Free(id);
    }
  }

  // Reserves a slot for slice `s` and gives its id: a work request can
  // carry the id before the slice's batch exists. The slice belongs to no
  // batch until the caller commits it (sets its `batch`, see
  // BatchPipeline::CreateBatch), or is erased.
  uint64_t AddSlice(const Slice& s) {
    Slice* slot;
    const uint64_t id = slices_.Take(&slot);
    *slot = s;
    return id;
  }
  // The same, committed to `batch` at once.
  uint64_t AddSlice(const Slice& s, BatchId batch) {
    Slice* slot;
    const uint64_t id = slices_.Take(&slot);
    *slot = s;
    slot->batch = batch;
    return id;
  }
  // A slice its caller fills in place: every field but its last error and
  // batch (reset here) is stale until then.
  uint64_t NewSlice(Slice** out) {
    const uint64_t id = slices_.Take(out);
    (*out)->batch = 0;
    (*out)->last_error = absl::OkStatus();
    return id;
  }
  Slice* FindSlice(uint64_t id) { return slices_.Find(id); }
  void EraseSlice(uint64_t id) { slices_.Free(id); }

 private:
  template <typename T>
  class Slab {
   public:
    explicit Slab(uint8_t tag) : tag_(tag) {}
    // A free slot (its value as its last user left it) and its id.
    uint64_t Take(T** out) {
      uint32_t index;
      if (!free_.empty()) {
        index = free_.back();
        free_.pop_back();
      } else {
        index = static_cast<uint32_t>(slots_.size());
        slots_.emplace_back();
      }
      Slot& s = slots_[index];
      s.live = true;
      s.generation = NextGeneration(s.generation);
      *out = &s.value;
      return IdOf(index, s.generation);
    }
    T* Find(uint64_t id) {
      const uint64_t index = (id & 0xffffffffu) - 1;
      if (index >= slots_.size()) return nullptr;
      Slot& s = slots_[index];
      return s.live && s.generation == ((id >> 32) & kGenerationMask) ? &s.value : nullptr;
    }
    void Free(uint64_t id) {
      if (Find(id) == nullptr) return;
      slots_[(id & 0xffffffffu) - 1].live = false;
      free_.push_back(static_cast<uint32_t>((id & 0xffffffffu) - 1));
    }

   private:
    static uint32_t NextGeneration(uint32_t g) {
      g = (g + 1) & kGenerationMask;
      return g == 0 ? 1 : g;  // never id 0
    }
    uint64_t IdOf(uint32_t index, uint32_t generation) const {
      return (uint64_t{tag_} << kTagShift) | (uint64_t{generation} << 32) | (uint64_t{index} + 1);
    }
    struct Slot {
      T value;
      uint32_t generation = 0;
      bool live = false;
    };
    const uint8_t tag_;
    std::vector<Slot> slots_;
    std::vector<uint32_t> free_;
  };
  Slab<Batch> batches_;
  Slab<Slice> slices_;
};

}  // namespace engine_internal
}  // namespace kvferry

#endif  // KVFERRY_ENGINE_PIPELINE_BATCH_TABLE_H_
