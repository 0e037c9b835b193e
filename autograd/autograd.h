// Autograd in one include: the engine, checkpointing and gradcheck.
//
//   Tensor w = randn({4, 4}).requires_grad_();
//   Tensor loss = sum(tanh(matmul(x, w)));
//   loss.backward();                          // w.grad() now holds d loss / d w
#pragma once

#include "autograd/aux_loss.h"
#include "autograd/checkpoint.h"
#include "autograd/derivatives.h"
#include "autograd/engine.h"
#include "autograd/gradcheck.h"
#include "autograd/node.h"
