// The KV pool layout that peer_main's prefill mode and peer_failure_test
// share: 4 layers of K and V, 64 pages of 4 KiB each.
#ifndef KVFERRY_TESTS_TEST_KV_LAYOUT_H_
#define KVFERRY_TESTS_TEST_KV_LAYOUT_H_

#include "kv/kv_cache.h"

namespace kvferry {

inline KvLayout TestKvLayout() {
  KvLayout l;
  l.layers = 4;
  l.combined_kv = false;
  l.page_tokens = 16;
  l.bytes_per_token = 256;
  l.pages = 64;
  return l;
}

}  // namespace kvferry

#endif  // KVFERRY_TESTS_TEST_KV_LAYOUT_H_
