// Command-line flags for the example programs: --name=value or --name value, typed, with
// defaults, help text and clear errors for unknown flags and bad values.
//
//   Config c;                                  // defaults live in the struct
//   Flags flags("mnist", "Trains a Fashion-MNIST classifier.");
//   flags.bind("epochs", c.epochs, "passes over the training set");
//   flags.bind("model", c.model, "mlp or cnn");
//   flags.parse(argc, argv);   // fills c; --help prints the table and exits 0
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <limits>
#include <utility>
#include <string>
#include <type_traits>
#include <variant>
#include <vector>

#include "tensor/dtype.h"

namespace tessera::models {

class Flags {
 public:
  Flags(std::string program, std::string description)
      : program_(std::move(program)), description_(std::move(description)) {}

  int64_t& add(const std::string& name, int64_t value, const std::string& help);
  double& add(const std::string& name, double value, const std::string& help);
  bool& add(const std::string& name, bool value, const std::string& help);
  std::string& add(const std::string& name, std::string value, const std::string& help);

  // A flag whose default is `target`'s value and whose parsed value parse() writes back
  // into it (integers of any width, double, bool, std::string). The parser may be moved
  // (its flags live in a deque, whose elements keep their addresses); `target` must outlive
  // parse().
  template <typename T>
  void bind(const std::string& name, T& target, const std::string& help) {
    if constexpr (std::is_same_v<T, bool> || std::is_same_v<T, double> ||
                  std::is_same_v<T, std::string>) {
      T& value = add(name, target, help);
      bindings_.push_back([&value, &target] { target = value; });
    } else {
      static_assert(std::is_integral_v<T>, "Flags::bind: unsupported type");
      int64_t& value = add(name, static_cast<int64_t>(target), help);
      // Captures no `this`: a Flags may be moved (returned from a function that binds it).
      bindings_.push_back([program = program_, name, &value, &target] {
        // A narrower field must hold the value exactly (no truncation, no sign change).
        check_fits(program, name, value, std::in_range<T>(value),
                   static_cast<int64_t>(std::numeric_limits<T>::min()),
                   static_cast<int64_t>(std::numeric_limits<T>::max()));
        target = static_cast<T>(value);
      });
    }
  }

  // Throws tessera::Error on an unknown flag or a value that does not parse; prints the
  // usage and exits 0 on --help.
  void parse(int argc, char** argv);
  // True when the flag was given on the command line.
  bool given(const std::string& name) const;
  std::string usage() const;

 private:
  struct Flag {
    std::string name, help;
    std::variant<int64_t, double, bool, std::string> value;
    bool given = false;
  };
  Flag& find(const std::string& name);
  static void check_fits(const std::string& program, const std::string& name, int64_t value,
                         bool fits, int64_t min, int64_t max);
  Flag& add_flag(const std::string& name, const std::string& help);

  std::string program_, description_;
  std::deque<Flag> flags_;  // stable addresses for the references handed out
  std::vector<std::function<void()>> bindings_;
};

// Range checks for a program's configuration, each an Error naming the program and the
// flag with the value ("gpt: --pp must be >= 1, got 0"): a value is refused, never clamped.
void require_at_least(const char* program, const char* flag, int64_t value, int64_t min);
// Finite and >= min (NaN and inf refused).
void require_finite_at_least(const char* program, const char* flag, double value, double min);
// In [0, 1) or, with include_one, [0, 1].
void require_fraction(const char* program, const char* flag, double value, bool include_one);
// One of `choices` ("gpipe, 1f1b or interleaved" in the message).
void require_one_of(const char* program, const char* flag, const std::string& value,
                    const std::vector<std::string>& choices);

// `bazel run` starts a program in its runfiles tree: a relative path given on the command
// line means the directory the user ran bazel from (BUILD_WORKING_DIRECTORY).
std::string from_user_dir(const std::string& path);

// --precision: f32 (autocast off), bf16 or f16; Error naming `program` otherwise.
DType precision_dtype(const std::string& precision, const char* program);

}  // namespace tessera::models
