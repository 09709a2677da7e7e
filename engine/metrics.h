// The engine's metrics (engine/metrics/metrics.h): this header keeps
// `#include "engine/metrics.h"`, the public name, working.
#ifndef KVFERRY_ENGINE_METRICS_H_
#define KVFERRY_ENGINE_METRICS_H_

#include "engine/metrics/metrics.h"         // IWYU pragma: export
#include "engine/metrics/metrics_server.h"  // IWYU pragma: export

#endif  // KVFERRY_ENGINE_METRICS_H_
