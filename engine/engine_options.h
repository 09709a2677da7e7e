// Checks of EngineOptions shared by Create and CreateWith.
#ifndef KVFERRY_ENGINE_ENGINE_OPTIONS_H_
#define KVFERRY_ENGINE_ENGINE_OPTIONS_H_

#include "absl/status/status.h"
#include "engine/transfer_engine.h"

namespace kvferry {
namespace engine_internal {

// kInvalidArgument naming the first option out of range.
absl::Status CheckOptions(const EngineOptions& o);

}  // namespace engine_internal
}  // namespace kvferry

#endif  // KVFERRY_ENGINE_ENGINE_OPTIONS_H_
