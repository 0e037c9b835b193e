#include "autograd/aux_loss.h"

#include "autograd/node.h"
#include "tensor/grad_mode.h"
#include "tensor/ops.h"

namespace tessera::autograd {
namespace {

thread_local double t_scale = 1.0;

class AttachLossNode final : public Node {
 public:
  AttachLossNode(double scale, DType aux_dtype, Device aux_device)
      : scale_(scale), dtype_(aux_dtype), device_(aux_device) {
    set_num_outputs(1);
  }
  std::string name() const override { return "attach_loss"; }
  std::vector<Tensor> apply(std::vector<Tensor>&& grads) override {
    return {std::move(grads[0]), full({}, scale_, dtype_, device_)};
  }

 private:
  double scale_;
  DType dtype_;
  Device device_;
};

}  // namespace

Tensor attach_loss(const Tensor& x, const Tensor& aux) {
  TS_CHECK(x.defined() && aux.defined() && aux.dim() == 0 && is_floating(aux.dtype()),
           "attach_loss: expected an activation and a 0-d floating loss, got {} and {}",
           x.defined() ? shape_str(x.shape()) : std::string("undefined"),
           aux.defined() ? fmt::format("{} {}", shape_str(aux.shape()), aux.dtype()) : std::string("undefined"));
  if (!GradMode::enabled() || (!x.requires_grad() && !aux.requires_grad())) return x;
  Tensor out = x.detach();
  auto node = std::make_shared<AttachLossNode>(t_scale, aux.dtype(), aux.device());
  node->mutable_next_edges().push_back(gradient_edge(x));
  node->mutable_next_edges().push_back(gradient_edge(aux));
  AutogradMeta& meta = out.ensure_autograd_meta();
  meta.grad_fn = node;
  meta.output_nr = 0;
  return out;
}

double aux_loss_scale() { return t_scale; }

AuxLossScale::AuxLossScale(double scale) : previous_(t_scale) { t_scale = scale; }
AuxLossScale::~AuxLossScale() { t_scale = previous_; }

}  // namespace tessera::autograd
