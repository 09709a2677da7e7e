// The VMM server and FetchVmm through the fake CUDA driver (a process may
// import its own exports, as another process on the host would).
#include "transport/cuda_ipc/vmm_share.h"

#include <dirent.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_format.h"
#include "cuda/driver.h"
#include "cuda/testing/fake_driver.h"
#include "gtest/gtest.h"

namespace kvferry {
namespace transport {
namespace {

class VmmShareTest : public ::testing::Test {
 protected:
  void SetUp() override {
    d_ = cuda::UseFakeDriver();
    ASSERT_NE(d_, nullptr);
    server_ = VmmServer::Get();
    ASSERT_NE(server_, nullptr);
    chunk_ = d_->VmmGranularity(0).value_or(0);
    ASSERT_GT(chunk_, 0u);
    auto base = d_->AllocVmm(0, chunk_, 2);
    ASSERT_TRUE(base.ok()) << base.status();
    base_ = static_cast<char*>(*base);
    pattern_.resize(2 * chunk_);
    for (size_t i = 0; i < pattern_.size(); ++i) pattern_[i] = static_cast<char>(i * 13 + 5);
    ASSERT_TRUE(d_->Copy(base_, pattern_.data(), pattern_.size(), 0).ok());
  }
  void TearDown() override {
    if (base_ != nullptr) EXPECT_TRUE(d_->FreeVmm(base_, chunk_, 2, 0).ok());
  }
  const cuda::Driver* d_ = nullptr;
  VmmServer* server_ = nullptr;
  uint64_t chunk_ = 0;
  char* base_ = nullptr;
  std::vector<char> pattern_;
};

TEST_F(VmmShareTest, AnExportIsMappedWholeAcrossItsChunks) {
  // A region from the middle of the first chunk into the second.
  const uint64_t offset = chunk_ - 4096, length = 8192 + 100;
  const uint64_t id = server_->Add(base_ + offset, length, 0);
  auto m = FetchVmm(server_->name(), id, 1);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->length, length);
  EXPECT_EQ(m->total, 2 * chunk_);
  std::vector<char> got(length);
  ASSERT_TRUE(d_->Copy(got.data(), m->start, length, 1).ok());
  EXPECT_TRUE(std::equal(got.begin(), got.end(), pattern_.begin() + offset));
  UnmapVmm(*m);
  server_->Remove(id);
  auto gone = FetchVmm(server_->name(), id, 1);
  EXPECT_EQ(gone.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(gone.status().message().find("no such VMM export"), std::string::npos) << gone.status();
}

TEST_F(VmmShareTest, UnknownIdsServersAndGarbageAreRefused) {
  auto unknown = FetchVmm(server_->name(), 12345, 0);
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kUnavailable);
  auto nobody = FetchVmm(server_->name() ^ 1, 12345, 0);
  EXPECT_EQ(nobody.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(nobody.status().message().find("cannot reach"), std::string::npos) << nobody.status();
  // Garbage, then a half request and a hang-up: the server answers the next.
  for (const std::string& junk : {std::string(16, 'x'), std::string(3, 'y')}) {
    const int fd = ::socket(AF_UNIX, SOCK_STREAM, 0);
    ASSERT_GE(fd, 0);
    sockaddr_un a{};
    a.sun_family = AF_UNIX;
    const std::string path = absl::StrFormat("kvferry-vmm-%016x", server_->name());
    std::memcpy(a.sun_path + 1, path.data(), path.size());
    ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&a),
                        static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + path.size())),
              0);
    ASSERT_EQ(::write(fd, junk.data(), junk.size()), static_cast<ssize_t>(junk.size()));
    if (junk.size() < 16) ::shutdown(fd, SHUT_WR);
    char reply[128];
    EXPECT_GT(::read(fd, reply, sizeof reply), 0);  // a refusal, not a hang
    ::close(fd);
  }
  const uint64_t id = server_->Add(base_, chunk_, 0);
  auto m = FetchVmm(server_->name(), id, 0);
  ASSERT_TRUE(m.ok()) << m.status();
  UnmapVmm(*m);
  server_->Remove(id);
}

// A server that answers nonsense (a chunk of zero bytes): refused as such,
// nothing mapped, every fd it sent closed.
TEST(VmmFetchTest, ANonsenseReplyIsRefused) {
  ASSERT_NE(cuda::UseFakeDriver(), nullptr);
  const uint64_t name = 0x5eedf00d5eedf00dull;
  const int lfd = ::socket(AF_UNIX, SOCK_STREAM, 0);
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  const std::string path = absl::StrFormat("kvferry-vmm-%016x", name);
  std::memcpy(a.sun_path + 1, path.data(), path.size());
  const socklen_t len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + path.size());
  ASSERT_EQ(::bind(lfd, reinterpret_cast<sockaddr*>(&a), len), 0);
  ASSERT_EQ(::listen(lfd, 1), 0);
  int pipe_fds[2];
  ASSERT_EQ(::pipe(pipe_fds), 0);
  std::thread server([&] {
    const int c = ::accept(lfd, nullptr, nullptr);
    char request[16];
    if (c < 0 || ::read(c, request, sizeof request) != sizeof request) return;
    struct {
      uint32_t code, count;
      uint64_t offset, length;
      char text[104];
    } reply{0, 1, 0, 4096, {}};
    const uint64_t size = 0;  // a chunk of nothing
    (void)::write(c, &reply, sizeof reply);
    (void)::write(c, &size, sizeof size);
    const uint32_t n = 1;
    iovec iov{const_cast<uint32_t*>(&n), sizeof n};
    char control[CMSG_SPACE(sizeof(int))] = {};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof control;
    cmsghdr* cm = CMSG_FIRSTHDR(&msg);
    cm->cmsg_level = SOL_SOCKET;
    cm->cmsg_type = SCM_RIGHTS;
    cm->cmsg_len = CMSG_LEN(sizeof(int));
    std::memcpy(CMSG_DATA(cm), &pipe_fds[0], sizeof(int));
    (void)::sendmsg(c, &msg, 0);
    ::close(c);
  });
  // The fds of this process open on the pipe: counted by what they point
  // at, not in all, which other tests' threads may change meanwhile.
  struct stat pipe_stat {};
  ASSERT_EQ(::fstat(pipe_fds[0], &pipe_stat), 0);
  const std::string pipe_name = absl::StrFormat("pipe:[%u]", pipe_stat.st_ino);
  auto fds_on_pipe = [&] {
    int n = 0;
    DIR* d = ::opendir("/proc/self/fd");
    while (dirent* e = d == nullptr ? nullptr : ::readdir(d)) {
      char target[64] = {};
      const std::string path = absl::StrFormat("/proc/self/fd/%s", e->d_name);
      if (::readlink(path.c_str(), target, sizeof target - 1) > 0 && pipe_name == target) ++n;
    }
    if (d != nullptr) ::closedir(d);
    return n;
  };
  ASSERT_EQ(fds_on_pipe(), 2);  // this test's two ends
  auto m = FetchVmm(name, 1, 0);
  server.join();
  EXPECT_EQ(m.status().code(), absl::StatusCode::kDataLoss) << m.status();
  EXPECT_EQ(fds_on_pipe(), 2);  // the fd it was sent was closed again
  ::close(lfd);
  ::close(pipe_fds[0]);
  ::close(pipe_fds[1]);
}

int ConnectTo(uint64_t name) {
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  const std::string path = absl::StrFormat("kvferry-vmm-%016x", name);
  std::memcpy(a.sun_path + 1, path.data(), path.size());
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a),
                static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + path.size())) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

// Local clients that trickle their requests (or send none) hold only their
// own connections: an import meanwhile is answered at once, not after
// their timeouts (it took 8 s behind two of them).
TEST_F(VmmShareTest, TricklingClientsDelayNoOtherImport) {
  std::vector<int> slow;
  for (int i = 0; i < 4; ++i) {
    slow.push_back(ConnectTo(server_->name()));
    ASSERT_GE(slow.back(), 0);
    ASSERT_EQ(::write(slow.back(), "k", 1), 1);  // one byte of 16, then silence
  }
  const uint64_t id = server_->Add(base_, chunk_, 0);
  const absl::Time start = absl::Now();
  auto m = FetchVmm(server_->name(), id, 0);
  const absl::Duration took = absl::Now() - start;
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_LT(took, absl::Milliseconds(400)) << took;
  UnmapVmm(*m);
  server_->Remove(id);
  // The slow ones are refused once their time is up.
  for (int fd : slow) {
    char reply[128];
    EXPECT_GT(::read(fd, reply, sizeof reply), 0);
    ::close(fd);
  }
}

// Another user's process is refused, whoever runs the server (root too:
// root's server used to answer uid 65534).
TEST_F(VmmShareTest, AnotherUserIsRefused) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to become another user";
  const uint64_t id = server_->Add(base_, chunk_, 0);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    if (::setgid(65534) != 0 || ::setuid(65534) != 0) ::_exit(2);
    const int fd = ConnectTo(server_->name());
    if (fd < 0) ::_exit(3);
    const uint64_t req[2] = {0x31306d6d7666766bull, id};
    if (::write(fd, req, sizeof req) != static_cast<ssize_t>(sizeof req)) ::_exit(4);
    uint32_t reply[32] = {};
    if (::read(fd, reply, sizeof reply) < 8) ::_exit(5);
    ::_exit(reply[0] == static_cast<uint32_t>(absl::StatusCode::kPermissionDenied) ? 0 : 6);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  server_->Remove(id);
  ASSERT_TRUE(WIFEXITED(status));
  // A sandbox without other users (Bazel's, in a user namespace).
  if (WEXITSTATUS(status) == 2) GTEST_SKIP() << "cannot become uid 65534 here";
  EXPECT_EQ(WEXITSTATUS(status), 0) << "3-5: the child could not ask; 6: it was not refused";
}

// A forked child that exits normally (running the process's exit handlers)
// leaves the parent's server serving.
TEST_F(VmmShareTest, AChildThatExitsLeavesTheServerServing) {
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) std::exit(0);
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status));
  const uint64_t id = server_->Add(base_, chunk_, 0);
  auto m = FetchVmm(server_->name(), id, 0);
  ASSERT_TRUE(m.ok()) << m.status();
  UnmapVmm(*m);
  server_->Remove(id);
}

}  // namespace
}  // namespace transport
}  // namespace kvferry
