// A prepared descriptor list, stored as runs of equal stride: consecutive
// indices whose descriptors have the same length and the same covering
// memory (a registration, or a span of the peer's adjacent regions) at a
// constant, increasing address step make one run. A KV pool's list (every
// block of every layer, millions of entries) is then a few runs per region,
// not one entry per block.
#ifndef KVFERRY_ENGINE_PREPARED_DESC_LIST_H_
#define KVFERRY_ENGINE_PREPARED_DESC_LIST_H_

#include <cstddef>
#include <cstdint>
#include <vector>

namespace kvferry {
namespace engine_internal {

class DescList {
 public:
  // One descriptor as a transfer uses it.
  struct Entry {
    uint64_t addr = 0;
    uint64_t length = 0;
    uint64_t bound = 0;  // where the memory covering it ends: merging stops there
  };

  // Appends the next descriptor (index size()).
  void Add(const Entry& e);
  // The descriptor at `index` (index < size()).
  Entry At(uint64_t index) const;
  uint64_t size() const { return size_; }
  size_t runs() const { return runs_.size(); }
  // Bytes the list takes.
  size_t bytes() const { return sizeof(*this) + runs_.capacity() * sizeof(Run); }

 private:
  struct Run {
    uint64_t first = 0;  // its first index
    uint64_t count = 0;
    uint64_t addr = 0;  // the first descriptor's
    uint64_t stride = 0;
    uint64_t length = 0;
    uint64_t bound = 0;
  };
  size_t RunOf(uint64_t index) const;
  std::vector<Run> runs_;
  uint64_t size_ = 0;
};

}  // namespace engine_internal
}  // namespace kvferry

#endif  // KVFERRY_ENGINE_PREPARED_DESC_LIST_H_
