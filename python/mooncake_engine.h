// kvferry.TransferEngine: Mooncake's Python engine on kvferry (see
// mooncake_engine.cc and docs/migrating-from-mooncake.md).
#ifndef KVFERRY_PYTHON_MOONCAKE_ENGINE_H_
#define KVFERRY_PYTHON_MOONCAKE_ENGINE_H_

#include <pybind11/pybind11.h>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "engine/transfer_engine.h"

namespace kvferry {
namespace python {

class MooncakeEngine {
 public:
  enum class Opcode { kRead = 0, kWrite = 1 };  // Mooncake's values
  struct Notify {
    std::string name;
    std::string msg;
  };

  ~MooncakeEngine();

  int initialize(const std::string& local_hostname, const std::string& metadata_server,
                 const std::string& protocol, const std::string& device_name);
  int initialize_ext(const std::string& local_hostname, const std::string& metadata_server,
                     const std::string& protocol, const std::string& device_name,
                     const std::string& metadata_type);
  int get_rpc_port();

  // Page-aligned memory registered with the engine; 0 on failure.
  uintptr_t allocate_managed_buffer(uint64_t length);
  int free_managed_buffer(uintptr_t buffer_addr, uint64_t length);

  int register_memory(uintptr_t addr, uint64_t length, const std::string& location,
                      const std::string& access);
  int unregister_memory(uintptr_t addr);
  int batch_register_memory(const std::vector<uintptr_t>& addrs,
                            const std::vector<uint64_t>& lengths, const std::string& location);
  int batch_unregister_memory(const std::vector<uintptr_t>& addrs);

  // transport_hint is accepted and ignored: kvferry chooses the transport
  // per peer (as Mooncake builds without TENT do).
  int transfer_sync_write(const std::string& target, uintptr_t buffer, uint64_t peer, uint64_t length,
                          const std::string&) {
    return Sync(target, Opcode::kWrite, {buffer}, {peer}, {length}, nullptr);
  }
  int transfer_sync_read(const std::string& target, uintptr_t buffer, uint64_t peer, uint64_t length,
                         const std::string&) {
    return Sync(target, Opcode::kRead, {buffer}, {peer}, {length}, nullptr);
  }
  int batch_transfer_sync_write(const std::string& target, const std::vector<uintptr_t>& buffers,
                                const std::vector<uint64_t>& peers,
                                const std::vector<uint64_t>& lengths, const std::string&) {
    return Sync(target, Opcode::kWrite, buffers, peers, lengths, nullptr);
  }
  int batch_transfer_sync_read(const std::string& target, const std::vector<uintptr_t>& buffers,
                               const std::vector<uint64_t>& peers,
                               const std::vector<uint64_t>& lengths, const std::string&) {
    return Sync(target, Opcode::kRead, buffers, peers, lengths, nullptr);
  }
  int transfer_sync(const std::string& target, uintptr_t buffer, uint64_t peer, uint64_t length,
                    Opcode op, const Notify* notify, const std::string&) {
    return Sync(target, op, {buffer}, {peer}, {length}, notify);
  }
  int batch_transfer_sync(const std::string& target, const std::vector<uintptr_t>& buffers,
                          const std::vector<uint64_t>& peers, const std::vector<uint64_t>& lengths,
                          Opcode op, const Notify* notify, const std::string&) {
    return Sync(target, op, buffers, peers, lengths, notify);
  }
  // A batch id (never 0), or 0 on failure.
  uint64_t batch_transfer_async_write(const std::string& target,
                                      const std::vector<uintptr_t>& buffers,
                                      const std::vector<uint64_t>& peers,
                                      const std::vector<uint64_t>& lengths, const std::string&) {
    return Async(target, Opcode::kWrite, buffers, peers, lengths);
  }
  uint64_t batch_transfer_async_read(const std::string& target,
                                     const std::vector<uintptr_t>& buffers,
                                     const std::vector<uint64_t>& peers,
                                     const std::vector<uint64_t>& lengths, const std::string&) {
    return Async(target, Opcode::kRead, buffers, peers, lengths);
  }
  uint64_t batch_transfer_async(const std::string& target, const std::vector<uintptr_t>& buffers,
                                const std::vector<uint64_t>& peers,
                                const std::vector<uint64_t>& lengths, Opcode op,
                                const std::string&) {
    return Async(target, op, buffers, peers, lengths);
  }
  // Stream-ordered (Mooncake's *_on_cuda): the transfer starts once the work
  // queued on `stream_ptr` (a cudaStream_t / CUstream as an integer; 0: the
  // legacy default stream) before the call has finished, and the stream's
  // later work waits for it. Returns None at once; raises RuntimeError when
  // it cannot be queued (no CUDA driver, no such peer, ...). A transfer
  // that fails once queued is logged (Mooncake ends the process instead).
  void transfer_write_on_cuda(const std::string& target, uintptr_t buffer, uint64_t peer,
                              uint64_t length, uintptr_t stream_ptr, const std::string&) {
    OnCuda(target, Opcode::kWrite, {buffer}, {peer}, {length}, stream_ptr);
  }
  void transfer_read_on_cuda(const std::string& target, uintptr_t buffer, uint64_t peer,
                             uint64_t length, uintptr_t stream_ptr, const std::string&) {
    OnCuda(target, Opcode::kRead, {buffer}, {peer}, {length}, stream_ptr);
  }
  void batch_transfer_write_on_cuda(const std::string& target,
                                    const std::vector<uintptr_t>& buffers,
                                    const std::vector<uint64_t>& peers,
                                    const std::vector<uint64_t>& lengths, uintptr_t stream_ptr,
                                    const std::string&) {
    OnCuda(target, Opcode::kWrite, buffers, peers, lengths, stream_ptr);
  }
  void batch_transfer_read_on_cuda(const std::string& target,
                                   const std::vector<uintptr_t>& buffers,
                                   const std::vector<uint64_t>& peers,
                                   const std::vector<uint64_t>& lengths, uintptr_t stream_ptr,
                                   const std::string&) {
    OnCuda(target, Opcode::kRead, buffers, peers, lengths, stream_ptr);
  }
  // Waits for every batch: 0 when all completed, -1 when one failed or
  // timed out. Completed batches are released.
  int get_batch_transfer_status(const std::vector<uint64_t>& batch_ids);
  // A batch id, or 0 (never a batch id) on failure, as Mooncake's.
  uint64_t transfer_submit_write(const std::string& target, uintptr_t buffer, uint64_t peer,
                                 uint64_t length, const std::string& transport_hint);
  // 1 completed, 0 pending, -1 failed, -2 past the timeout (Mooncake's).
  int transfer_check_status(uint64_t batch_id);

  int write_bytes_to_buffer(uintptr_t dest_address, const pybind11::bytes& src, uint64_t length);
  pybind11::bytes read_bytes_from_buffer(uintptr_t source_address, uint64_t length);

  std::string get_local_topology(const std::optional<std::string>& device_name);
  uintptr_t get_first_buffer_address(const std::string& segment_name);
  // Opens the segment now: handshake and links before the first transfer.
  int warmup_efa_segment(const std::string& segment_name);
  std::vector<Notify> get_notifies();
  int send_probe(const std::string& peer_server_name);
  std::shared_ptr<TransferEngine> get_engine();
  uintptr_t get_engine_ptr();

  std::string get_last_error() const { return last_error_; }
  std::string get_local_address() const { return engine_ == nullptr ? "" : engine_->address(); }

 private:
  struct Pending {
    absl::Time start;
    absl::Duration timeout;
  };
  static std::string DefaultAccess();
  static absl::StatusOr<std::vector<TransferRequest>> Requests(
      Opcode op, const std::vector<uintptr_t>& local, const std::vector<uint64_t>& remote,
      const std::vector<uint64_t>& lengths);
  absl::StatusOr<std::unique_ptr<TransferEngine>> CreateWithFallbacks(EngineOptions o);
  int Sync(const std::string& target, Opcode op, const std::vector<uintptr_t>& local,
           const std::vector<uint64_t>& remote, const std::vector<uint64_t>& lengths,
           const Notify* notify);
  uint64_t Async(const std::string& target, Opcode op, const std::vector<uintptr_t>& local,
                 const std::vector<uint64_t>& remote, const std::vector<uint64_t>& lengths);
  void OnCuda(const std::string& target, Opcode op, const std::vector<uintptr_t>& local,
              const std::vector<uint64_t>& remote, const std::vector<uint64_t>& lengths,
              uintptr_t stream);
  absl::Duration Timeout(uint64_t bytes) const;
  void Forget(uint64_t batch_id);
  // Every call starts with a clean last error; Ready() also says whether
  // initialize() succeeded.
  void Begin() { last_error_.clear(); }
  bool Ready();
  int Fail(const absl::Status& s);
  int Result(const absl::Status& s) { return s.ok() ? 0 : Fail(s); }

  std::shared_ptr<TransferEngine> engine_;
  absl::Duration transfer_timeout_ = absl::Seconds(30);  // MC_TRANSFER_TIMEOUT
  std::string last_error_;  // written with the GIL held
  std::mutex mu_;
  std::map<uint64_t, Pending> batches_;     // async batches not yet collected
  std::map<uintptr_t, uint64_t> managed_;   // allocate_managed_buffer: address -> length
};

// Adds TransferEngine, TransferOpcode, TransferNotify, InnerTransferEngine
// and the SUPPORT_* flags to the module.
void BindMooncake(pybind11::module_& m);

}  // namespace python
}  // namespace kvferry

#endif  // KVFERRY_PYTHON_MOONCAKE_ENGINE_H_
