#include "engine/batch_table.h"

#include <utility>

namespace kvferry {
namespace engine_internal {

void Batch::Reset() {
  segment = 0;
  peer_engine_id = 0;
  bound = false;
  landed = 0;
  submitted = absl::Time();
  op.clear();
  length.clear();
  slices_left.clear();
  status.clear();
  pending = 0;
}

void Batch::StatusTo(BatchStatus* out) const {
  out->pending = pending;
  out->succeeded = 0;
  out->failed = 0;
  out->requests.clear();
  out->requests.reserve(status.size());
  for (size_t i = 0; i < status.size(); ++i) {
    if (slices_left[i] > 0) {
      out->requests.push_back(absl::UnavailableError("pending"));
    } else {
      out->requests.push_back(status[i]);
      ++(status[i].ok() ? out->succeeded : out->failed);
    }
  }
}

BatchId BatchTable::Create(Batch** out) {
  const BatchId id = ++last_batch_;
  Batch& b = batches_[id];
  if (!spare_.empty()) {
    b = std::move(spare_.back());  // vectors with capacity, emptied
    spare_.pop_back();
  }
  *out = &b;
  return id;
}

Batch* BatchTable::Find(BatchId id) {
  auto it = batches_.find(id);
  return it == batches_.end() ? nullptr : &it->second;
}

void BatchTable::Recycle(BatchId id) {
  auto it = batches_.find(id);
  if (it == batches_.end()) return;
  if (spare_.size() < kSpareBatches) {
    it->second.Reset();
    spare_.push_back(std::move(it->second));
  }
  batches_.erase(it);
}

uint64_t BatchTable::AddSlice(const Slice& s) {
  const uint64_t id = ++last_slice_;
  slices_.emplace(id, s);
  return id;
}

Slice* BatchTable::FindSlice(uint64_t id) {
  auto it = slices_.find(id);
  return it == slices_.end() ? nullptr : &it->second;
}

}  // namespace engine_internal
}  // namespace kvferry
