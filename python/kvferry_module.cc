// The kvferry Python module (pybind11):
//
//   from kvferry import TransferEngine      # instead of: from mooncake.engine import TransferEngine
//
// TransferEngine mirrors the methods serving frameworks call on Mooncake's
// Python engine, with the same arguments and return conventions (0 on
// success, a negative number on failure; the reason is logged and kept for
// get_last_error()). metadata_server "P2PHANDSHAKE" (or empty) is the only
// mode: peers are named "host:port" (get_rpc_port() gives ours).
//
// Engine, KvPool, KvSender and KvReceiver are the Pythonic API: failures
// raise kvferry.Error (a RuntimeError) carrying the engine's message and
// status code. The GIL is released while the engine works.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "base/logging.h"
#include "engine/kv_cache.h"
#include "engine/metrics.h"
#include "engine/transfer_engine.h"
#include "python/module_util.h"
#include "python/mooncake_engine.h"

namespace py = pybind11;

namespace kvferry {
namespace {

using python::Check;
using python::ParseAccess;
using python::Raise;
using python::RunBatch;
using python::Value;

// Runs `fn` (which returns a Status or StatusOr) with the GIL released.
template <typename Fn>
auto Unlocked(Fn&& fn) {
  py::gil_scoped_release release;
  return fn();
}

// --------------------------------------------------------------- Pythonic

class Engine {
 public:
  Engine(const std::string& host, int port, const std::string& transport,
         const std::vector<std::string>& devices, int metrics_port,
         const std::string& metrics_host) {
    EngineOptions o;
    o.local_host = host;
    o.port = static_cast<uint16_t>(port);
    o.transport = transport;
    o.devices = devices;
    o.metrics_port = metrics_port;
    o.metrics_host = metrics_host;
    absl::StatusOr<std::unique_ptr<TransferEngine>> e;
    {
      py::gil_scoped_release release;
      e = TransferEngine::Create(o);
    }
    engine_ = Value(std::move(e));
  }
  TransferEngine* get() { return engine_.get(); }
  std::string address() const { return engine_->address(); }
  std::string transport() const { return engine_->detection().transport; }
  void register_memory(uintptr_t addr, uint64_t length, const std::string& location,
                       const std::string& access) {
    const transport::Access a = Value(ParseAccess(access));
    Check(Unlocked([&] {
      return engine_->RegisterMemory(reinterpret_cast<void*>(addr), length, a, location);
    }));
  }
  void unregister_memory(uintptr_t addr) {
    Check(Unlocked([&] { return engine_->UnregisterMemory(reinterpret_cast<void*>(addr)); }));
  }
  // [(op, local, remote, length)] with op "write" or "read"; raises on any
  // failed request (the message names it).
  void transfer(const std::string& peer,
                const std::vector<std::tuple<std::string, uintptr_t, uint64_t, uint64_t>>& reqs,
                double timeout_s) {
    std::vector<TransferRequest> requests;
    for (const auto& [op, local, remote, length] : reqs) {
      if (op != "write" && op != "read") {
        Raise(absl::InvalidArgumentError(absl::StrCat("op '", op, "': write or read")));
      }
      requests.push_back({op == "write" ? transport::Opcode::kWrite : transport::Opcode::kRead,
                          reinterpret_cast<void*>(local), remote, length});
    }
    Check(RunBatch(*engine_, peer, requests, absl::Seconds(timeout_s)));
  }
  py::dict metrics() const {
    const EngineMetrics m = engine_->GetMetrics();
    py::dict out;
    py::list peers;
    for (const PeerMetrics& p : m.peers) {
      py::dict d;
      d["peer"] = p.peer;
      d["requests"] = p.requests;
      d["requests_ok"] = p.requests_ok;
      d["bytes_written"] = p.bytes_written;
      d["bytes_read"] = p.bytes_read;
      d["slices"] = p.slices;
      d["retries"] = p.retries;
      d["reconnects"] = p.reconnects;
      d["errors"] = p.errors;
      d["latency_p50_s"] = p.latency.QuantileBound(0.5);
      d["latency_p99_s"] = p.latency.QuantileBound(0.99);
      peers.append(d);
    }
    py::list nics;
    for (const NicMetrics& n : m.nics) {
      py::dict d;
      d["name"] = n.name;
      d["slices"] = n.slices;
      d["bytes"] = n.bytes;
      d["errors"] = n.errors;
      d["errors_by_code"] = n.errors_by_code;
      d["retries"] = n.retries;
      nics.append(d);
    }
    out["peers"] = peers;
    out["nics"] = nics;
    out["prometheus"] = PrometheusText(m, engine_->address());
    return out;
  }
  std::string metrics_address() const { return engine_->metrics_address(); }

 private:
  std::unique_ptr<TransferEngine> engine_;
};

KvLayout Layout(uint32_t layers, bool combined_kv, uint32_t page_tokens,
                uint64_t bytes_per_token, uint32_t pages) {
  KvLayout l{layers, combined_kv, page_tokens, bytes_per_token, pages};
  Check(l.Validate());
  return l;
}

// A pool over buffers the caller owns: one address per layer (and K/V).
KvPool WrapPool(uint32_t layers, bool combined_kv, uint32_t page_tokens,
                uint64_t bytes_per_token, uint32_t pages, const std::vector<uintptr_t>& buffers) {
  std::vector<void*> b;
  for (uintptr_t a : buffers) b.push_back(reinterpret_cast<void*>(a));
  return Value(KvPool::Wrap(Layout(layers, combined_kv, page_tokens, bytes_per_token, pages), b));
}

}  // namespace
}  // namespace kvferry

PYBIND11_MODULE(kvferry, m) {
  using namespace kvferry;
  m.doc() = "kvferry: zero-configuration KV-cache transfer engine";
  static py::exception<std::runtime_error> error(m, "Error", PyExc_RuntimeError);
  python::g_error = error.ptr();

  python::BindMooncake(m);

  py::class_<Engine>(m, "Engine", "A kvferry engine; failures raise kvferry.Error.")
      .def(py::init<const std::string&, int, const std::string&, const std::vector<std::string>&,
                    int, const std::string&>(),
           py::arg("host") = "", py::arg("port") = 0, py::arg("transport") = "auto",
           py::arg("devices") = std::vector<std::string>{}, py::arg("metrics_port") = -1,
           py::arg("metrics_host") = "127.0.0.1")
      .def_property_readonly("address", &Engine::address)
      .def_property_readonly("transport", &Engine::transport)
      .def_property_readonly("metrics_address", &Engine::metrics_address)
      .def("register_memory", &Engine::register_memory, py::arg("addr"), py::arg("length"),
           py::arg("location") = "", py::arg("access") = "w",
           "Registers [addr, +length): host memory or GPU memory (a torch tensor's "
           "data_ptr(); told apart through the CUDA driver). location: \"cpu:N\" or "
           "\"cuda:N\", checked against the memory when the CUDA driver is present. "
           "access: what peers may do: \"w\" write (the default), \"r\" read, \"rw\", "
           "\"none\".")
      .def("unregister_memory", &Engine::unregister_memory, py::arg("addr"))
      .def("transfer", &Engine::transfer, py::arg("peer"), py::arg("requests"),
           py::arg("timeout") = 30.0)
      .def("metrics", &Engine::metrics);

  py::class_<KvPool>(m, "KvPool", "Where a KV pool's buffers are.")
      .def(py::init(&WrapPool), py::arg("layers"), py::arg("combined_kv"), py::arg("page_tokens"),
           py::arg("bytes_per_token"), py::arg("pages"), py::arg("buffers"));

  py::class_<KvSender>(m, "KvSender", "Sends a request's KV pages to a decode engine.")
      .def(py::init([](Engine& e, const KvPool& pool) {
             return Value(KvSender::Create(e.get(), pool));
           }),
           py::arg("engine"), py::arg("pool"), py::keep_alive<1, 2>())
      .def(
          "send",
          [](KvSender& s, const std::string& request_id, const std::string& peer,
             const std::vector<uint32_t>& src_pages, const std::vector<uint32_t>& dst_pages,
             const std::string& aux) {
            absl::Status st;
            {
              py::gil_scoped_release release;
              st = s.Send(request_id, peer, src_pages, dst_pages, aux);
            }
            Check(st);
          },
          py::arg("request_id"), py::arg("peer"), py::arg("src_pages"), py::arg("dst_pages"),
          py::arg("aux") = "")
      .def(
          "begin",
          [](KvSender& s, const std::string& request_id, const std::string& peer,
             const std::vector<uint32_t>& src_pages, const std::vector<uint32_t>& dst_pages) {
            return Value(Unlocked([&] { return s.Begin(request_id, peer, src_pages, dst_pages); }));
          },
          py::arg("request_id"), py::arg("peer"), py::arg("src_pages"), py::arg("dst_pages"),
          "Starts a request (checks pages and layouts; sends nothing); returns its handle "
          "for send_layer, send_all, finish and cancel.")
      .def(
          "send_layer",
          [](KvSender& s, KvSender::Handle h, uint32_t layer) {
            Check(Unlocked([&] { return s.SendLayer(h, layer); }));
          },
          py::arg("handle"), py::arg("layer"), "Sends one layer now (layer-wise mode).")
      .def(
          "send_all",
          [](KvSender& s, KvSender::Handle h) {
            Check(Unlocked([&] { return s.SendAll(h); }));
          },
          py::arg("handle"), "Sends every layer not sent yet.")
      .def(
          "finish",
          [](KvSender& s, KvSender::Handle h, const std::string& aux) {
            Check(Unlocked([&] { return s.Finish(h, aux); }));
          },
          py::arg("handle"), py::arg("aux") = "",
          "Sends what remains, waits for every byte, then tells the decode the request is "
          "complete (or, on failure, that it failed).")
      .def(
          "cancel",
          [](KvSender& s, KvSender::Handle h, const std::string& reason) {
            Check(Unlocked([&] { return s.Cancel(h, reason); }));
          },
          py::arg("handle"), py::arg("reason") = "",
          "Stops sending, waits for what is in flight, tells the decode the request failed.");

  py::class_<KvReceiver>(m, "KvReceiver", "Receives KV pages into a pool.")
      .def(py::init([](Engine& e, const KvPool& pool, double peer_timeout_s) {
             KvReceiver::Options o;
             o.peer_timeout = absl::Seconds(peer_timeout_s);
             return Value(KvReceiver::Create(e.get(), pool, o));
           }),
           py::arg("engine"), py::arg("pool"), py::arg("peer_timeout") = 4.0,
           py::keep_alive<1, 2>())
      .def(
          "expect",
          [](KvReceiver& r, const std::string& request_id, const std::string& prefill,
             uint64_t engine_id) {
            Check(Unlocked([&] { return r.Expect(request_id, prefill, engine_id); }));
          },
          py::arg("request_id"), py::arg("prefill"), py::arg("engine_id") = 0,
          "Declares a request to come from the prefill at 'host:port': if that prefill dies, "
          "freezes or cannot be reached for peer_timeout first, the request fails (and the "
          "prefill is fenced: nothing of it lands afterwards).")
      .def(
          "poll",
          [](KvReceiver& r, const std::string& request_id) -> py::object {
            KvReceiver::Status s = r.Poll(request_id);
            if (s.state == KvReceiver::State::kFailed) Raise(s.error);
            if (s.state == KvReceiver::State::kPending) return py::none();
            return py::bytes(s.aux);
          },
          py::arg("request_id"),
          "None while pending, the aux bytes once complete; raises kvferry.Error if it failed.")
      .def(
          "forget", [](KvReceiver& r, const std::string& request_id) { r.Forget(request_id); },
          py::arg("request_id"), "Forgets a finished request, so its id can be used again.")
      .def(
          "wait",
          [](KvReceiver& r, const std::string& request_id, double timeout_s) {
            absl::StatusOr<KvReceiver::Status> st;
            {
              py::gil_scoped_release release;
              st = r.Wait(request_id, absl::Seconds(timeout_s));
            }
            KvReceiver::Status s = Value(std::move(st));
            if (s.state == KvReceiver::State::kFailed) Raise(s.error);
            if (s.state == KvReceiver::State::kPending) {
              Raise(absl::DeadlineExceededError(
                  absl::StrCat("KV request ", request_id, " still pending")));
            }
            return py::bytes(s.aux);
          },
          py::arg("request_id"), py::arg("timeout") = 30.0);
}
