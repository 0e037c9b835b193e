// Tessera in one include: tensors, ops, autograd.
//
//   #include "tessera.h"
//   using namespace tessera;
//   Tensor w = randn({16, 4}).requires_grad_();
//   cross_entropy(matmul(x, w), y).backward();
#pragma once

#include "autograd/autograd.h"
#include "tensor/ops.h"
