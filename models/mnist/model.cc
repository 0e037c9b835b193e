#include "models/mnist/model.h"

namespace tessera::mnist {

std::shared_ptr<nn::Sequential> make_mlp() {
  return std::make_shared<nn::Sequential>(std::vector<std::shared_ptr<nn::Module>>{
      std::make_shared<nn::Flatten>(), std::make_shared<nn::Linear>(784, 256),
      std::make_shared<nn::ReLU>(), std::make_shared<nn::Linear>(256, 10)});
}

std::shared_ptr<nn::Sequential> make_cnn() {
  return std::make_shared<nn::Sequential>(std::vector<std::shared_ptr<nn::Module>>{
      std::make_shared<nn::Conv2d>(1, 32, std::array<int64_t, 2>{3, 3},
                                   std::array<int64_t, 2>{1, 1}, std::array<int64_t, 2>{1, 1}),
      std::make_shared<nn::ReLU>(),
      std::make_shared<nn::MaxPool2d>(std::array<int64_t, 2>{2, 2}),
      std::make_shared<nn::Conv2d>(32, 64, std::array<int64_t, 2>{3, 3},
                                   std::array<int64_t, 2>{1, 1}, std::array<int64_t, 2>{1, 1}),
      std::make_shared<nn::ReLU>(),
      std::make_shared<nn::MaxPool2d>(std::array<int64_t, 2>{2, 2}),
      std::make_shared<nn::Flatten>(),
      std::make_shared<nn::Linear>(64 * 7 * 7, 128),
      std::make_shared<nn::ReLU>(),
      std::make_shared<nn::Linear>(128, 10)});
}

std::shared_ptr<nn::Sequential> make_model(const std::string& name) {
  if (name == "mlp") return make_mlp();
  if (name == "cnn") return make_cnn();
  fail("mnist: unknown --model '{}'; expected mlp or cnn", name);
}

}  // namespace tessera::mnist
