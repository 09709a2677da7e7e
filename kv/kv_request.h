// What the decode side knows of one KV request (KvReceiver::Poll, Wait).
#ifndef KVFERRY_KV_KV_REQUEST_H_
#define KVFERRY_KV_KV_REQUEST_H_

#include <string>

#include "absl/status/status.h"

namespace kvferry {

enum class KvRequestState { kPending, kComplete, kFailed };

struct KvRequestStatus {
  KvRequestState state = KvRequestState::kPending;
  absl::Status error;  // kFailed: why
  std::string aux;     // kComplete: the sender's auxiliary payload
};

}  // namespace kvferry

#endif  // KVFERRY_KV_KV_REQUEST_H_
