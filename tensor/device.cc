#include "tensor/device.h"

#include <charconv>

#include "tensor/error.h"

namespace tessera {

std::string Device::str() const {
  if (type == DeviceType::cpu) return "cpu";
  return fmt::format("cuda:{}", index);
}

Device Device::parse(std::string_view text) {
  if (text == "cpu") return kCPU;
  if (text == "cuda") return Device(DeviceType::cuda, 0);
  if (text.starts_with("cuda:")) {
    std::string_view num = text.substr(5);
    int index = -1;
    auto [ptr, ec] = std::from_chars(num.data(), num.data() + num.size(), index);
    if (ec == std::errc() && ptr == num.data() + num.size() && index >= 0 && index < 32768) {
      return Device(DeviceType::cuda, index);
    }
  }
  fail("device: cannot parse '{}' (expected cpu, cuda or cuda:N)", text);
}

}  // namespace tessera
