// Walks the op list (tensor/op_list.h) and checks that every layer has its entry: a CPU
// kernel for Compute and Factory ops, shape inference for Compute ops, a view function for
// View ops, a derivative for Diff ops (Composite ones are differentiated through the ops they
// are written with), and no derivative for NoDiff ops. Adding an op to the list without
// these fails here.
#include <doctest/doctest.h>

#include <set>
#include <string>

#include "autograd/autograd.h"
#include "tensor/ops.h"

namespace tessera {
namespace {

TEST_CASE("the op list is well formed") {
  REQUIRE(static_cast<int>(all_ops().size()) == kNumOps);
  std::set<std::string_view> names;
  for (int i = 0; i < kNumOps; ++i) {
    const OpInfo& info = all_ops()[i];
    CHECK(static_cast<int>(info.id) == i);
    CHECK(op_name(info.id) == info.name);
    CHECK_MESSAGE(names.insert(info.name).second, "op name ", info.name, " appears twice");
  }
  // Spot checks that the X-macro columns land in the right fields.
  CHECK(op_info(OpId::add).kind == OpKind::Compute);
  CHECK(op_info(OpId::add).differentiable);
  CHECK(op_info(OpId::eq).kind == OpKind::Compute);
  CHECK_FALSE(op_info(OpId::eq).differentiable);
  CHECK(op_info(OpId::view).kind == OpKind::View);
  CHECK(op_info(OpId::randn).kind == OpKind::Factory);
  CHECK_FALSE(op_info(OpId::randn).differentiable);
  CHECK(op_info(OpId::stack).kind == OpKind::Composite);
  CHECK(op_info(OpId::stack).differentiable);
  CHECK(op_name(OpId::layer_norm_backward) == "layer_norm_backward");
}

TEST_CASE("every op has its kernel, shape inference, view function and derivative") {
  int compute = 0, view = 0, factory = 0, composite = 0, derivatives = 0;
  for (const OpInfo& info : all_ops()) {
    CAPTURE(info.name);
    const bool has_kernel = kernel_fn(DeviceType::cpu, info.id) != nullptr;
    const bool has_meta = meta_fn(info.id) != nullptr;
    const bool has_view = view_fn(info.id) != nullptr;
    const bool has_derivative = autograd::derivative_for(info.id) != nullptr;
    switch (info.kind) {
      case OpKind::Compute:
        ++compute;
        CHECK_MESSAGE(has_kernel, info.name, ": Compute op without a CPU kernel");
        CHECK_MESSAGE(has_meta, info.name, ": Compute op without shape inference (meta_fn)");
        CHECK_MESSAGE(!has_view, info.name, ": Compute op with a view function");
        break;
      case OpKind::Factory:
        ++factory;
        CHECK_MESSAGE(has_kernel, info.name, ": Factory op without a CPU kernel");
        CHECK_MESSAGE(has_meta, info.name, ": Factory op without shape inference (meta_fn)");
        break;
      case OpKind::View:
        ++view;
        CHECK_MESSAGE(has_view, info.name, ": View op without a view function");
        CHECK_MESSAGE(!has_kernel, info.name, ": View op with a kernel (views move no data)");
        break;
      case OpKind::Composite:
        ++composite;
        CHECK_MESSAGE(!has_kernel, info.name, ": Composite op with a kernel");
        CHECK_MESSAGE(!has_view, info.name, ": Composite op with a view function");
        CHECK_MESSAGE(!has_derivative, info.name,
                      ": Composite op with a derivative (it is differentiated through its parts)");
        break;
    }
    if (info.differentiable && info.kind != OpKind::Composite) {
      CHECK_MESSAGE(has_derivative, info.name, ": marked Diff but has no derivative");
    }
    if (!info.differentiable) {
      CHECK_MESSAGE(!has_derivative, info.name, ": marked NoDiff but has a derivative registered");
    }
    derivatives += has_derivative ? 1 : 0;
  }
  CHECK(compute + view + factory + composite == kNumOps);
  CHECK(view > 0);
  CHECK(factory > 0);
  CHECK(derivatives > 40);
}

}  // namespace
}  // namespace tessera
