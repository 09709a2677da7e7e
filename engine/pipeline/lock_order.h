// The batch pipeline's locks, in the order they are taken.
#ifndef KVFERRY_ENGINE_PIPELINE_LOCK_ORDER_H_
#define KVFERRY_ENGINE_PIPELINE_LOCK_ORDER_H_

namespace kvferry {
namespace engine_internal {

// The pipeline's lock order, first taken first (base/mutex.h levels; a
// debug build aborts on a lock taken out of this order):
//   the books (SegmentRegistry: segments, links' state, counters)
//   < a lane (its batches and slices; one lane at a time)
//   < the retry queue (Delivery) < the completion pump < transport events
//   < finished announced batches (engine/prepared: FinishedQueue).
enum PipelineLockLevel : int {
  kBooksLock = 1,
  kLaneLock = 2,
  kRetryLock = 3,
  kPumpLock = 4,
  kEventsLock = 5,
  kFinishedLock = 6,
};

}  // namespace engine_internal
}  // namespace kvferry

#endif  // KVFERRY_ENGINE_PIPELINE_LOCK_ORDER_H_
