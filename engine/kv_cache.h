// The KV layer moved to kv/kv_cache.h (target //kv); this header keeps
// `#include "engine/kv_cache.h"` working for code written before the move.
#ifndef KVFERRY_ENGINE_KV_CACHE_H_
#define KVFERRY_ENGINE_KV_CACHE_H_

#include "kv/kv_cache.h"  // IWYU pragma: export

#endif  // KVFERRY_ENGINE_KV_CACHE_H_
