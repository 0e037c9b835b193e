// Helpers shared by the fuzz targets (tools/fuzz/*_fuzzer.cc): the readers under test take
// file paths, so each input is written to files in a private scratch directory first.
//
//   const std::string path = fuzz::write_file("x.safetensors", data, size);
//   fuzz::Bytes in(data, size);  uint32_t n = in.u32();  std::string part = in.take(n);
#pragma once

#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

namespace tessera::fuzz {

// This process's scratch directory (TMPDIR or /tmp), created on first use.
inline const std::string& scratch_dir() {
  static const std::string dir = [] {
    const char* tmp = std::getenv("TMPDIR");
    std::string d = std::string(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") +
                    "/tessera-fuzz-" + std::to_string(::getpid());
    std::string cmd = "mkdir -p '" + d + "'";
    if (std::system(cmd.c_str()) != 0) std::abort();
    return d;
  }();
  return dir;
}

// Writes `size` bytes to scratch_dir()/name (replacing it) and returns the path.
inline std::string write_file(const std::string& name, const void* data, size_t size) {
  const std::string path = scratch_dir() + "/" + name;
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) std::abort();
  if (size > 0 && std::fwrite(data, 1, size, f) != size) std::abort();
  std::fclose(f);
  return path;
}

inline std::string write_file(const std::string& name, const std::string& bytes) {
  return write_file(name, bytes.data(), bytes.size());
}

// Reads an input front to back; past the end every read gives zeros / empty strings.
class Bytes {
 public:
  Bytes(const uint8_t* data, size_t size) : p_(data), n_(size) {}
  uint8_t u8() { return n_ > 0 ? (--n_, *p_++) : 0; }
  uint32_t u32() {
    uint32_t v = 0;
    for (int i = 0; i < 4; ++i) v = v << 8 | u8();
    return v;
  }
  std::string take(size_t n) {
    n = n < n_ ? n : n_;
    std::string s(reinterpret_cast<const char*>(p_), n);
    p_ += n;
    n_ -= n;
    return s;
  }
  std::string rest() { return take(n_); }
  size_t left() const { return n_; }

 private:
  const uint8_t* p_;
  size_t n_;
};

}  // namespace tessera::fuzz
