#include "parallel/pipeline/executor.h"

#include <fmt/format.h>

#include <map>
#include <utility>

#include "autograd/checkpoint.h"
#include "parallel/comm/comm_log.h"
#include "tensor/error.h"
#include "tensor/grad_mode.h"
#include "tensor/ops.h"

namespace tessera::parallel::pipeline {

namespace {

constexpr int kMaxDims = 8;

// A transfer's tags: its kind, micro-batch and the stage that receives it, then header (0)
// or data (1).
int tag_of(bool grad, int microbatch, int stage, int stages, int part) {
  return (((microbatch * stages + stage) * 2 + (grad ? 1 : 0)) * 2) + part;
}

struct Sent {
  WorkHandle header, data;
  Tensor header_buf, data_buf;  // alive until the sends complete
};

void send_tensor(Communicator& pp, const Tensor& t, int dst, int tag, std::vector<Sent>& sent) {
  TS_CHECK(t.dim() <= kMaxDims, "pipeline: a transfer of {} dims (at most {})", t.dim(), kMaxDims);
  std::vector<int64_t> header(kMaxDims + 2, 0);
  header[0] = static_cast<int64_t>(t.dtype());
  header[1] = t.dim();
  for (int64_t d = 0; d < t.dim(); ++d) header[2 + d] = t.size(d);
  Sent s;
  s.header_buf = Tensor::from_vector<int64_t>(header, {kMaxDims + 2});
  s.data_buf = t.contiguous();
  s.header = pp.send_async(s.header_buf, dst, tag);
  s.data = pp.send_async(s.data_buf, dst, tag + 1);
  sent.push_back(std::move(s));
}

Tensor recv_tensor(Communicator& pp, int src, int tag) {
  Tensor header = Tensor::empty({kMaxDims + 2}, DType::i64);
  pp.recv_async(header, src, tag)->wait();
  const std::vector<int64_t> h = header.to_vector<int64_t>();
  Shape shape(h.begin() + 2, h.begin() + 2 + h[1]);
  Tensor t = Tensor::empty(shape, static_cast<DType>(h[0]));
  pp.recv_async(t, src, tag + 1)->wait();
  return t;
}

// What a micro-batch chunk keeps between its forward and backward.
struct Live {
  Tensor input;   // the received activation (a leaf requiring grad), or stage 0's input
  Tensor output;  // the chunk's output, or on the last stage the micro-batch's loss / m
};

}  // namespace

PipelineStep run_pipeline(Communicator& pp, const Schedule& s, const PipelineChunks& chunks,
                          const std::function<Tensor(int)>& input,
                          const std::function<Tensor(const Tensor&, int)>& loss,
                          PipelineOptions options) {
  TS_CHECK(pp.size() == s.ranks,
           "run_pipeline: the {} schedule is for {} ranks, the pipeline group '{}' has {}",
           s.name, s.ranks, pp.name(), pp.size());
  TS_CHECK(static_cast<int>(chunks.size()) == s.chunks,
           "run_pipeline: the {} schedule runs {} chunks per rank, rank {} has {}", s.name,
           s.chunks, pp.rank(), chunks.size());
  const int me = pp.rank(), stages = s.num_stages(), last = stages - 1;
  const double inv_m = 1.0 / s.microbatches;
  std::map<std::pair<int, int>, Live> live;  // (micro-batch, chunk)
  std::map<std::pair<int, int>, Tensor> received;  // activations / gradients waiting for use
  std::vector<Sent> sent;
  PipelineStep step;
  double loss_sum = 0.0;
  CommCause cause(fmt::format("pipeline {}", s.name));

  for (const Action& a : s.actions[me]) {
    const int stage = s.stage_of(me, a.chunk);
    const std::pair<int, int> key{a.microbatch, a.chunk};
    switch (a.kind) {
      case ActionKind::recv_activation:
      case ActionKind::recv_grad: {
        const bool grad = a.kind == ActionKind::recv_grad;
        received[key] = recv_tensor(pp, a.peer, tag_of(grad, a.microbatch, stage, stages, 0));
        break;
      }
      case ActionKind::send_activation:
        send_tensor(pp, live.at(key).output.detach(), a.peer,
                    tag_of(false, a.microbatch, stage + 1, stages, 0), sent);
        break;
      case ActionKind::send_grad: {
        const Tensor g = live.at(key).input.grad();
        TS_CHECK(g.defined(), "run_pipeline: stage {} produced no gradient for its input of "
                 "micro-batch {} (does the chunk use its input?)", stage, a.microbatch);
        send_tensor(pp, g, a.peer, tag_of(true, a.microbatch, stage - 1, stages, 0), sent);
        live.erase(key);
        break;
      }
      case ActionKind::forward: {
        Tensor x;
        if (stage == 0) {
          x = input(a.microbatch);
        } else if (s.rank_of(stage - 1) == me) {  // the previous chunk is ours: hand over
          x = live.at({a.microbatch, s.chunk_of(stage - 1)}).output.detach();
          x.requires_grad_();
        } else {
          x = received.at(key);
          received.erase(key);
          x.requires_grad_();
        }
        Tensor y;
        const PipelineChunk& fn = chunks[a.chunk];
        if (options.recompute) {
          y = autograd::checkpoint(
              [&fn, mb = a.microbatch](const std::vector<Tensor>& in) {
                return std::vector<Tensor>{fn(in[0], mb)};
              },
              {x})[0];
        } else {
          y = fn(x, a.microbatch);
        }
        if (stage == last) {
          const Tensor l = loss(y, a.microbatch);
          loss_sum += l.item<double>();
          y = l * (inv_m * options.loss_scale);
        }
        live[key] = {x, y};
        step.peak_live = std::max(step.peak_live, static_cast<int>(live.size()));
        step.executed.push_back(a);
        break;
      }
      case ActionKind::backward: {
        Live& l = live.at(key);
        if (stage == last) {
          l.output.backward();
        } else {
          Tensor g;
          if (s.rank_of(stage + 1) == me) {  // the next chunk is ours
            const std::pair<int, int> next{a.microbatch, s.chunk_of(stage + 1)};
            g = live.at(next).input.grad();
            live.erase(next);
          } else {
            g = received.at(key);
            received.erase(key);
          }
          l.output.backward(g);
        }
        l.output = Tensor();  // the graph is consumed; the input's .grad stays for the send
        if (stage == 0) live.erase(key);  // nothing to send back
        step.executed.push_back(a);
        break;
      }
    }
  }
  for (Sent& x : sent) {
    x.header->wait();
    x.data->wait();
  }
  // Every rank reports the step's loss: the last stage's rank has it.
  Tensor total = Tensor::from_vector<double>({me == s.rank_of(last) ? loss_sum * inv_m : 0.0}, {1});
  pp.all_reduce(total, ReduceOp::sum);
  step.loss = total.item<double>();
  return step;
}

void run_pipeline_forward(Communicator& pp, const Schedule& s, const PipelineChunks& chunks,
                          const std::function<Tensor(int)>& input) {
  TS_CHECK(pp.size() == s.ranks && static_cast<int>(chunks.size()) == s.chunks,
           "run_pipeline_forward: the {} schedule is for {} ranks and {} chunks, got {} and {}",
           s.name, s.ranks, s.chunks, pp.size(), chunks.size());
  const NoGradGuard no_grad;
  const CommCause cause(fmt::format("pipeline {} forward only", s.name));
  const int me = pp.rank(), stages = s.num_stages();
  std::vector<Sent> sent;
  for (int mb = 0; mb < s.microbatches; ++mb) {
    Tensor carried;  // the previous stage's output, when this rank ran it
    for (int stage = 0; stage < stages; ++stage) {
      if (s.rank_of(stage) != me) continue;
      Tensor x;
      if (stage == 0) {
        x = input(mb);
      } else if (s.rank_of(stage - 1) == me) {
        x = carried;
      } else {
        x = recv_tensor(pp, s.rank_of(stage - 1), tag_of(false, mb, stage, stages, 0));
      }
      carried = chunks[static_cast<size_t>(stage / s.ranks)](x, mb);
      if (stage + 1 < stages && s.rank_of(stage + 1) != me) {
        send_tensor(pp, carried, s.rank_of(stage + 1), tag_of(false, mb, stage + 1, stages, 0), sent);
      }
    }
  }
  for (Sent& x : sent) {
    x.header->wait();
    x.data->wait();
  }
}

}  // namespace tessera::parallel::pipeline
