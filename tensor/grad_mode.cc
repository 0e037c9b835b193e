#include "tensor/grad_mode.h"

namespace tessera {
namespace {
thread_local bool t_grad_enabled = true;
}

bool GradMode::enabled() { return t_grad_enabled; }
void GradMode::set_enabled(bool enabled) { t_grad_enabled = enabled; }

}  // namespace tessera
