// Command-line flags for the example programs: --name=value or --name value, typed, with
// defaults, help text and clear errors for unknown flags and bad values.
//
//   Flags flags("mnist", "Trains a Fashion-MNIST classifier.");
//   int64_t& epochs = flags.add("epochs", int64_t{10}, "passes over the training set");
//   std::string& model = flags.add("model", std::string("mlp"), "mlp or cnn");
//   flags.parse(argc, argv);   // --help prints the table and exits 0
#pragma once

#include <cstdint>
#include <deque>
#include <string>
#include <variant>
#include <vector>

namespace tessera::models {

class Flags {
 public:
  Flags(std::string program, std::string description)
      : program_(std::move(program)), description_(std::move(description)) {}

  int64_t& add(const std::string& name, int64_t value, const std::string& help);
  double& add(const std::string& name, double value, const std::string& help);
  bool& add(const std::string& name, bool value, const std::string& help);
  std::string& add(const std::string& name, std::string value, const std::string& help);

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
  Flag& add_flag(const std::string& name, const std::string& help);

  std::string program_, description_;
  std::deque<Flag> flags_;  // stable addresses for the references handed out
};

}  // namespace tessera::models
