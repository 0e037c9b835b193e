// Devices: cpu, and cuda:N for the CUDA backend (kernels/cuda, built under --config=cuda).
//
//   Device d = Device::parse("cuda:1");   // {DeviceType::cuda, 1}
//   if (t.device() == kCPU) ...
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include <fmt/format.h>

namespace tessera {

enum class DeviceType : uint8_t { cpu = 0, cuda = 1 };
inline constexpr int kNumDeviceTypes = 2;

struct Device {
  DeviceType type = DeviceType::cpu;
  int16_t index = 0;

  constexpr Device() = default;
  constexpr Device(DeviceType t, int i = 0) : type(t), index(static_cast<int16_t>(i)) {}

  constexpr bool is_cpu() const { return type == DeviceType::cpu; }
  constexpr bool is_cuda() const { return type == DeviceType::cuda; }
  friend constexpr bool operator==(Device a, Device b) = default;

  std::string str() const;
  // "cpu", "cuda", "cuda:N"; throws Error on anything else.
  static Device parse(std::string_view text);
};

inline constexpr Device kCPU{DeviceType::cpu, 0};
inline Device cuda(int index = 0) { return Device(DeviceType::cuda, index); }

}  // namespace tessera

template <>
struct fmt::formatter<tessera::Device> : fmt::formatter<std::string_view> {
  auto format(tessera::Device d, format_context& ctx) const {
    return fmt::formatter<std::string_view>::format(d.str(), ctx);
  }
};
