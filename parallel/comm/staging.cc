#include "parallel/comm/staging.h"

#include <exception>
#include <mutex>

#include "tensor/grad_mode.h"
#include "tensor/ops.h"

namespace tessera::parallel::internal {
namespace {

class CopyBackWork final : public Work {
 public:
  CopyBackWork(WorkHandle inner, Tensor device, Tensor host)
      : inner_(std::move(inner)), device_(std::move(device)), host_(std::move(host)) {}

  void wait() override {
    std::lock_guard<std::mutex> lock(mu_);
    complete_locked();
    if (error_) std::rethrow_exception(error_);
  }

  // Like the backends' handles, never throws: a failure is kept for wait().
  bool is_completed() override {
    std::lock_guard<std::mutex> lock(mu_);
    if (done_) return true;
    if (!inner_->is_completed()) return false;
    complete_locked();
    return true;
  }

 private:
  void complete_locked() {
    if (done_) return;
    done_ = true;
    try {
      inner_->wait();
      if (device_.defined()) {
        NoGradGuard no_grad;  // the buffers are a collective's, never part of a graph
        device_.copy_(host_);
      }
    } catch (...) {
      error_ = std::current_exception();
    }
    device_ = Tensor();
    host_ = Tensor();
  }

  WorkHandle inner_;
  Tensor device_, host_;
  std::mutex mu_;
  bool done_ = false;
  std::exception_ptr error_;
};

}  // namespace

Tensor host_copy(const Tensor& t) {
  NoGradGuard no_grad;
  return t.to(kCPU);
}

Tensor host_buffer(const Tensor& t) { return Tensor::empty(t.shape(), t.dtype(), kCPU); }

WorkHandle copy_back(WorkHandle inner, Tensor device, Tensor host) {
  return std::make_shared<CopyBackWork>(std::move(inner), std::move(device), std::move(host));
}

}  // namespace tessera::parallel::internal
