// Starting a thread without the chance of std::terminate: std::thread throws
// when the system refuses a thread (EAGAIN at a thread or memory limit), and
// kvferry turns that into a status its caller can report.
#ifndef KVFERRY_BASE_THREAD_H_
#define KVFERRY_BASE_THREAD_H_

#include <string>
#include <system_error>
#include <thread>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

namespace kvferry {

// kResourceExhausted naming `what` when the thread cannot be created.
template <typename Fn>
absl::StatusOr<std::thread> StartThread(const std::string& what, Fn&& fn) {
  try {
    return std::thread(std::forward<Fn>(fn));
  } catch (const std::system_error& e) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot start a thread for ", what, ": ", e.what()));
  }
}

}  // namespace kvferry

#endif  // KVFERRY_BASE_THREAD_H_
