#include "engine/peer/secret.h"

#include <arpa/inet.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "base/errno_status.h"
#include "base/logging.h"
#include "handshake/auth.h"
#include "net/interfaces.h"

namespace kvferry {
namespace engine_internal {

absl::StatusOr<std::string> ResolveSecret(const std::string& configured) {
  if (!configured.empty()) return configured;
  const char* env = std::getenv(handshake::kSecretEnv);
  const char* file = std::getenv(kSecretFileEnv);
  const bool have_env = env != nullptr && *env != '\0';
  const bool have_file = file != nullptr && *file != '\0';
  if (have_env && have_file) {
    return absl::InvalidArgumentError(
        absl::StrCat("both ", handshake::kSecretEnv, " and ", kSecretFileEnv, " are set: set one"));
  }
  if (have_env) return std::string(env);
  if (!have_file) return std::string();
  std::ifstream in(file, std::ios::binary);
  if (!in) return ErrnoError(errno, absl::StrCat(kSecretFileEnv, " ", file));
  std::stringstream contents;
  contents << in.rdbuf();
  std::string secret = contents.str();
  if (!secret.empty() && secret.back() == '\n') secret.pop_back();
  if (!secret.empty() && secret.back() == '\r') secret.pop_back();
  if (secret.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(kSecretFileEnv, " ", file, " is empty"));
  }
  struct stat st;
  if (::stat(file, &st) == 0 && (st.st_mode & (S_IRGRP | S_IROTH)) != 0) {
    KVF_LOG(WARNING) << kSecretFileEnv << " " << file
                     << " is readable by other users: chmod 600 it";
  }
  return secret;
}

bool WarnIfUnauthenticated(bool has_secret, const std::string& bind_host) {
  if (has_secret || net::IsLoopbackHost(bind_host)) return false;
  // Only real network addresses: the simulator's hosts are names.
  in6_addr any;
  if (::inet_pton(AF_INET, bind_host.c_str(), &any) != 1 &&
      ::inet_pton(AF_INET6, bind_host.c_str(), &any) != 1) {
    return false;
  }
  KVF_LOG(WARNING) << "no handshake secret, and this engine listens on " << bind_host
                   << ": anyone who can reach it can pair with it and write (and read, where "
                      "registered readable) its registered memory, and send it notifications. "
                      "Set the same secret (16 bytes or more) on every engine with "
                   << handshake::kSecretEnv << " or " << kSecretFileEnv
                   << " (see docs/security.md).";
  return true;
}

}  // namespace engine_internal
}  // namespace kvferry
