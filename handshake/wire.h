// Bounds-checked little-endian encoding for handshake messages. Writer
// appends; Reader consumes and fails (returns false, then stays failed) on
// any read past the end or any length above its limit, so a decoder can
// read a whole message and check ok() once.
#ifndef KVFERRY_HANDSHAKE_WIRE_H_
#define KVFERRY_HANDSHAKE_WIRE_H_

#include <cstdint>
#include <cstring>
#include <string>

#include "absl/strings/string_view.h"

namespace kvferry {
namespace handshake {

class Writer {
 public:
  explicit Writer(std::string* out) : out_(out) {}
  void U8(uint8_t v) { out_->push_back(static_cast<char>(v)); }
  void U16(uint16_t v) { Le(v, 2); }
  void U32(uint32_t v) { Le(v, 4); }
  void U64(uint64_t v) { Le(v, 8); }
  void I32(int32_t v) { U32(static_cast<uint32_t>(v)); }
  // A u32 length, then the bytes.
  void Bytes(absl::string_view b) {
    U32(static_cast<uint32_t>(b.size()));
    out_->append(b.data(), b.size());
  }

 private:
  void Le(uint64_t v, int n) {
    for (int i = 0; i < n; ++i) out_->push_back(static_cast<char>(v >> (8 * i)));
  }
  std::string* out_;
};

class Reader {
 public:
  explicit Reader(absl::string_view in) : in_(in) {}
  bool U8(uint8_t* v) { return Le(v, 1); }
  bool U16(uint16_t* v) { return Le(v, 2); }
  bool U32(uint32_t* v) { return Le(v, 4); }
  bool U64(uint64_t* v) { return Le(v, 8); }
  bool I32(int32_t* v) {
    uint32_t u;
    if (!U32(&u)) return false;
    *v = static_cast<int32_t>(u);
    return true;
  }
  // Reads a u32 length and that many bytes; fails above `max_len`.
  bool Bytes(std::string* out, uint32_t max_len) {
    uint32_t len;
    if (!U32(&len)) return false;
    if (len > max_len || len > in_.size()) return Fail();
    out->assign(in_.data(), len);
    in_.remove_prefix(len);
    return true;
  }
  // Reads a u32 count and fails above `max`.
  bool Count(uint32_t* n, uint32_t max) {
    if (!U32(n)) return false;
    return *n <= max ? true : Fail();
  }
  bool ok() const { return ok_; }
  bool AtEnd() const { return ok_ && in_.empty(); }
  size_t remaining() const { return in_.size(); }

 private:
  template <typename T>
  bool Le(T* v, size_t n) {
    if (!ok_ || in_.size() < n) return Fail();
    uint64_t x = 0;
    for (size_t i = 0; i < n; ++i) {
      x |= static_cast<uint64_t>(static_cast<uint8_t>(in_[i])) << (8 * i);
    }
    *v = static_cast<T>(x);
    in_.remove_prefix(n);
    return true;
  }
  bool Fail() {
    ok_ = false;
    return false;
  }
  absl::string_view in_;
  bool ok_ = true;
};

}  // namespace handshake
}  // namespace kvferry

#endif  // KVFERRY_HANDSHAKE_WIRE_H_
