// Tessera in one include: tensors, ops, autograd, nn layers, optimizers, mixed precision.
//
//   #include "tessera.h"
//   using namespace tessera;
//   Tensor w = randn({16, 4}).requires_grad_();
//   cross_entropy(matmul(x, w), y).backward();
#pragma once

#include "autograd/autograd.h"
#include "nn/init.h"
#include "nn/layers.h"
#include "optim/adamw.h"
#include "optim/clip.h"
#include "optim/loss_scaler.h"
#include "optim/schedule.h"
#include "optim/sgd.h"
#include "tensor/autocast.h"
#include "tensor/ops.h"
