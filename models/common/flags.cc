#include "models/common/flags.h"

#include <fmt/format.h>

#include <cerrno>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "tensor/error.h"

namespace tessera::models {

Flags::Flag& Flags::add_flag(const std::string& name, const std::string& help) {
  for (const Flag& f : flags_) {
    TS_CHECK(f.name != name, "{}: flag --{} defined twice", program_, name);
  }
  flags_.push_back(Flag{name, help, int64_t{0}, false});
  return flags_.back();
}

int64_t& Flags::add(const std::string& name, int64_t value, const std::string& help) {
  Flag& f = add_flag(name, help);
  f.value = value;
  return std::get<int64_t>(f.value);
}
double& Flags::add(const std::string& name, double value, const std::string& help) {
  Flag& f = add_flag(name, help);
  f.value = value;
  return std::get<double>(f.value);
}
bool& Flags::add(const std::string& name, bool value, const std::string& help) {
  Flag& f = add_flag(name, help);
  f.value = value;
  return std::get<bool>(f.value);
}
std::string& Flags::add(const std::string& name, std::string value, const std::string& help) {
  Flag& f = add_flag(name, help);
  f.value = std::move(value);
  return std::get<std::string>(f.value);
}

Flags::Flag& Flags::find(const std::string& name) {
  for (Flag& f : flags_) {
    if (f.name == name) return f;
  }
  fail("{}: unknown flag --{}\n{}", program_, name, usage());
}

void Flags::check_fits(const std::string& program, const std::string& name, int64_t value,
                       bool fits, int64_t min, int64_t max) {
  TS_CHECK(fits, "{}: --{}={} is out of range [{}, {}]", program, name, value, min, max);
}

bool Flags::given(const std::string& name) const {
  for (const Flag& f : flags_) {
    if (f.name == name) return f.given;
  }
  return false;
}

void Flags::parse(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      std::printf("%s", usage().c_str());
      std::exit(0);
    }
    TS_CHECK(arg.rfind("--", 0) == 0 && arg.size() > 2, "{}: unexpected argument '{}'\n{}",
             program_, arg, usage());
    std::string name = arg.substr(2), text;
    bool has_value = false;
    if (const size_t eq = name.find('='); eq != std::string::npos) {
      text = name.substr(eq + 1);
      name = name.substr(0, eq);
      has_value = true;
    }
    Flag& f = find(name);
    f.given = true;
    if (std::holds_alternative<bool>(f.value) && !has_value) {
      f.value = true;
      continue;
    }
    if (!has_value) {
      TS_CHECK(i + 1 < argc, "{}: flag --{} needs a value", program_, name);
      text = argv[++i];
    }
    const char* s = text.c_str();
    char* end = nullptr;
    errno = 0;
    if (std::holds_alternative<int64_t>(f.value)) {
      const long long v = std::strtoll(s, &end, 10);
      TS_CHECK(!text.empty() && *end == '\0', "{}: --{} expects an integer, got '{}'", program_,
               name, text);
      // strtoll clamps to INT64_MIN/MAX and sets ERANGE: a silent clamp is a wrong value.
      TS_CHECK(errno != ERANGE, "{}: --{}={} is out of range (an integer must lie in [{}, {}])",
               program_, name, text, INT64_MIN, INT64_MAX);
      f.value = static_cast<int64_t>(v);
    } else if (std::holds_alternative<double>(f.value)) {
      const double v = std::strtod(s, &end);
      TS_CHECK(!text.empty() && *end == '\0', "{}: --{} expects a number, got '{}'", program_,
               name, text);
      // strtod returns +-HUGE_VAL on overflow and a zero or subnormal on underflow.
      TS_CHECK(errno != ERANGE || std::fabs(v) < 1.0,
               "{}: --{}={} is out of range for a double", program_, name, text);
      TS_CHECK(errno != ERANGE, "{}: --{}={} is too small to represent (it would round to {})",
               program_, name, text, v);
      f.value = v;
    } else if (std::holds_alternative<bool>(f.value)) {
      TS_CHECK(text == "true" || text == "false" || text == "1" || text == "0",
               "{}: --{} expects true or false, got '{}'", program_, name, text);
      f.value = text == "true" || text == "1";
    } else {
      f.value = text;
    }
  }
  for (const auto& write_back : bindings_) write_back();
}

std::string Flags::usage() const {
  std::string out = fmt::format("usage: {} [--flag=value ...]\n{}\n\nflags:\n", program_, description_);
  for (const Flag& f : flags_) {
    const std::string def = std::visit(
        [](const auto& v) -> std::string {
          using T = std::decay_t<decltype(v)>;
          if constexpr (std::is_same_v<T, bool>) return v ? "true" : "false";
          else if constexpr (std::is_same_v<T, std::string>) return "'" + v + "'";
          else return fmt::format("{}", v);
        },
        f.value);
    out += fmt::format("  --{:<14} {} (default {})\n", f.name, f.help, def);
  }
  return out;
}

void require_at_least(const char* program, const char* flag, int64_t value, int64_t min) {
  TS_CHECK(value >= min, "{}: --{} must be >= {}, got {}", program, flag, min, value);
}

void require_finite_at_least(const char* program, const char* flag, double value, double min) {
  TS_CHECK(std::isfinite(value) && value >= min, "{}: --{} must be a finite number >= {}, got {}",
           program, flag, min, value);
}

void require_fraction(const char* program, const char* flag, double value, bool include_one) {
  TS_CHECK(std::isfinite(value) && value >= 0 && (include_one ? value <= 1 : value < 1),
           "{}: --{} must be in [0, 1{}, got {}", program, flag, include_one ? "]" : ")", value);
}

void require_one_of(const char* program, const char* flag, const std::string& value,
                    const std::vector<std::string>& choices) {
  for (const std::string& c : choices) {
    if (value == c) return;
  }
  std::string list;
  for (size_t i = 0; i < choices.size(); ++i) {
    list += (i == 0 ? "" : i + 1 == choices.size() ? " or " : ", ") + choices[i];
  }
  fail("{}: --{} must be {}, got '{}'", program, flag, list, value);
}

std::string from_user_dir(const std::string& path) {
  const char* dir = std::getenv("BUILD_WORKING_DIRECTORY");
  if (path.empty() || path[0] == '/' || dir == nullptr) return path;
  return std::string(dir) + "/" + path;
}

DType precision_dtype(const std::string& precision, const char* program) {
  if (precision == "f32") return DType::f32;  // AutocastGuard(f32) = autocast off
  if (precision == "bf16") return DType::bf16;
  if (precision == "f16") return DType::f16;
  fail("{}: unknown --precision '{}'; expected f32, bf16 or f16", program, precision);
}

}  // namespace tessera::models
