// The C++ example in README.md ("## A short example"), compiled and checked so the README
// never rots: the README's ```cpp block must be exactly the lines between the markers in
// readme_example() below, wrapped in the README's `#include "tessera.h"`, `using namespace
// tessera;` and `int main() { ... }` (this file has the same include and using-directive;
// main belongs to the test runner, so the body lives in a function that also returns the
// final loss for checking). Edit the two together.
#include <doctest/doctest.h>

#include <fstream>
#include <sstream>
#include <cstddef>
#include <string>
#include <vector>

#include "tessera.h"

using namespace tessera;

namespace {

Tensor readme_example() {
  // README example begins
  manual_seed(0);
  Tensor x = randn({64, 16});                              // a batch of inputs
  Tensor y = argmax(x.narrow(1, 0, 4), 1);                 // labels: i64, shape [64]
  nn::MLP model({16, 32, 4});                              // Linear, ReLU, Linear
  optim::AdamW opt(model.parameters(), {.lr = 1e-2});

  for (int step = 0; step < 100; ++step) {
    opt.zero_grad();
    Tensor loss = cross_entropy(model.forward(x), y);      // fused log-softmax + NLL
    loss.backward();                                       // fills each parameter's grad()
    opt.step();                                            // one fused AdamW pass per tensor
  }
  // README example ends
  NoGradGuard no_grad;
  return cross_entropy(model.forward(x), y);
}

std::string read(const std::string& path) {
  std::ifstream in(path);
  REQUIRE_MESSAGE(in.good(), "cannot open " << path << " (a data dependency of this test)");
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// The lines of `text` without its leading and trailing blank (whitespace-only) lines.
std::vector<std::string> lines_trimmed(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  auto blank = [](const std::string& l) {
    return l.find_first_not_of(" \t\r") == std::string::npos;
  };
  while (!lines.empty() && blank(lines.back())) lines.pop_back();
  size_t first = 0;
  while (first < lines.size() && blank(lines[first])) ++first;
  return std::vector<std::string>(lines.begin() + static_cast<std::ptrdiff_t>(first), lines.end());
}

}  // namespace

TEST_CASE("the README's C++ example is the code this test runs") {
  const std::string readme = read("README.md");
  const size_t section = readme.find("\n## A short example\n");
  REQUIRE_MESSAGE(section != std::string::npos, "README.md has no '## A short example' section");
  const std::string fence = "\n```cpp\n";
  const size_t open = readme.find(fence, section);
  REQUIRE_MESSAGE(open != std::string::npos, "no ```cpp block after '## A short example'");
  const size_t body = open + fence.size();
  const size_t close = readme.find("\n```\n", body - 1);
  REQUIRE(close != std::string::npos);
  const std::string block = readme.substr(body, close + 1 - body);

  const std::string code = read("tests/docs/readme_example_test.cc");
  const std::string begin = "  // README example begins\n", end = "  // README example ends\n";
  const size_t a = code.find(begin);
  const size_t b = code.find(end, a);
  REQUIRE(a != std::string::npos);
  REQUIRE(b != std::string::npos);
  const std::string expected = "#include \"tessera.h\"\nusing namespace tessera;\n\n"
                               "int main() {\n" +
                               code.substr(a + begin.size(), b - a - begin.size()) + "}\n";
  CHECK_MESSAGE(lines_trimmed(block) == lines_trimmed(expected),
                "README.md's example differs from readme_example() in "
                "tests/docs/readme_example_test.cc.\nREADME:\n"
                    << block << "\ntest:\n"
                    << expected);
}

TEST_CASE("the README example trains") {
  const Tensor loss = readme_example();
  // Starts at ~ln 4 = 1.39; 100 AdamW steps on a separable problem drive it near zero.
  CHECK(loss.item<float>() < 0.1f);
}
