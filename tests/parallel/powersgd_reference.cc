#include "tests/parallel/powersgd_reference.h"

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <memory>

#include "parallel/comm/comm_log.h"
#include "parallel/data_parallel.h"
#include "tensor/ops.h"

namespace tessera::parallel::testing_powersgd {

Params::Params() : nn::Module("Params") {
  for (const auto& [name, shape] : shapes()) register_parameter(name, zeros(shape, DType::f64));
}

std::vector<std::pair<std::string, Shape>> Params::shapes() {
  return {{"w1", {16, 12}}, {"bias", {16}}, {"w3", {4, 3}}, {"kernel", {6, 4, 5}}};
}

std::vector<double> grad_values(int rank, int t, size_t k, int64_t n) {
  std::vector<double> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    v[static_cast<size_t>(i)] = std::sin(0.37 * static_cast<double>(i + 1) * static_cast<double>(k + 1) +
                                         1.3 * rank + 0.71 * t) +
                                0.1 * static_cast<double>(rank - t);
  }
  return v;
}

Tensor q0_of(int bucket, int tensor, const Shape& shape) {
  std::vector<double> v(static_cast<size_t>(numel_of(shape)));
  for (size_t i = 0; i < v.size(); ++i) {
    v[i] = std::cos(0.9 * static_cast<double>(i) + 0.3 * tensor + 0.1 * bucket);
  }
  return Tensor::from_vector<double>(v, shape);
}

// ---- the f64 reference: plain row-major arrays ---------------------------------------------
namespace {

Mat matmul_ref(const Mat& a, const Mat& b, int64_t n, int64_t k, int64_t m) {  // [n,k] x [k,m]
  Mat out(static_cast<size_t>(n * m), 0.0);
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < m; ++j) {
      double s = 0;
      for (int64_t l = 0; l < k; ++l) s += a[static_cast<size_t>(i * k + l)] * b[static_cast<size_t>(l * m + j)];
      out[static_cast<size_t>(i * m + j)] = s;
    }
  }
  return out;
}

Mat transpose_ref(const Mat& a, int64_t n, int64_t m) {
  Mat out(a.size());
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < m; ++j) out[static_cast<size_t>(j * n + i)] = a[static_cast<size_t>(i * m + j)];
  }
  return out;
}

void gram_schmidt_ref(Mat& a, int64_t n, int64_t k) {
  for (int64_t c = 0; c < k; ++c) {
    double norm = 0;
    for (int64_t i = 0; i < n; ++i) norm += a[static_cast<size_t>(i * k + c)] * a[static_cast<size_t>(i * k + c)];
    norm = std::sqrt(norm);
    for (int64_t i = 0; i < n; ++i) a[static_cast<size_t>(i * k + c)] /= norm;
    for (int64_t d = c + 1; d < k; ++d) {
      double dot = 0;
      for (int64_t i = 0; i < n; ++i) dot += a[static_cast<size_t>(i * k + c)] * a[static_cast<size_t>(i * k + d)];
      for (int64_t i = 0; i < n; ++i) a[static_cast<size_t>(i * k + d)] -= dot * a[static_cast<size_t>(i * k + c)];
    }
  }
}

}  // namespace

std::vector<RefParam> ref_params(int ranks, int64_t rank) {
  std::vector<RefParam> ref;
  for (const auto& [name, shape] : Params::shapes()) {
    RefParam p;
    p.name = name;
    p.shape = shape;
    p.n = shape[0];
    p.cols = numel_of(shape) / p.n;
    p.r = std::min({p.n, p.cols, rank});
    p.compressed = shape.size() >= 2 && p.n * p.cols > 2 * (p.n + p.cols) * p.r;
    p.error.assign(static_cast<size_t>(ranks), Mat(static_cast<size_t>(numel_of(shape)), 0.0));
    ref.push_back(p);
  }
  return ref;
}

std::vector<std::vector<Mat>> reference(std::vector<RefParam>& params, int ranks, int rounds,
                                        int64_t start_iter, const Places& places) {
  std::vector<std::vector<Mat>> out;
  for (int t = 0; t < rounds; ++t) {
    std::vector<Mat> results;
    for (size_t k = 0; k < params.size(); ++k) {
      RefParam& p = params[k];
      const int64_t numel = numel_of(p.shape);
      std::vector<Mat> input(static_cast<size_t>(ranks));
      for (int w = 0; w < ranks; ++w) {
        input[static_cast<size_t>(w)] = grad_values(w, t, k, numel);
        if (t >= start_iter) {
          for (int64_t i = 0; i < numel; ++i) {
            input[static_cast<size_t>(w)][static_cast<size_t>(i)] += p.error[static_cast<size_t>(w)][static_cast<size_t>(i)];
          }
        }
      }
      Mat result(static_cast<size_t>(numel), 0.0);
      if (t < start_iter || !p.compressed) {
        for (int w = 0; w < ranks; ++w) {
          for (int64_t i = 0; i < numel; ++i) result[static_cast<size_t>(i)] += input[static_cast<size_t>(w)][static_cast<size_t>(i)];
        }
        for (double& x : result) x /= ranks;
      } else {
        if (p.q.empty()) {
          const auto [bucket, index] = places.at(p.name);
          const Tensor q0 = q0_of(bucket, index, {p.cols, p.r});
          p.q = q0.to_vector<double>();
        }
        gram_schmidt_ref(p.q, p.cols, p.r);
        Mat psum(static_cast<size_t>(p.n * p.r), 0.0);
        for (int w = 0; w < ranks; ++w) {
          const Mat pw = matmul_ref(input[static_cast<size_t>(w)], p.q, p.n, p.cols, p.r);
          for (size_t i = 0; i < psum.size(); ++i) psum[i] += pw[i];
        }
        gram_schmidt_ref(psum, p.n, p.r);
        Mat qsum(static_cast<size_t>(p.cols * p.r), 0.0);
        for (int w = 0; w < ranks; ++w) {
          const Mat qw = matmul_ref(transpose_ref(input[static_cast<size_t>(w)], p.n, p.cols), psum,
                                    p.cols, p.n, p.r);
          for (size_t i = 0; i < qsum.size(); ++i) qsum[i] += qw[i];
        }
        for (double& x : qsum) x /= ranks;
        p.q = qsum;
        result = matmul_ref(psum, transpose_ref(qsum, p.cols, p.r), p.n, p.r, p.cols);
      }
      if (t >= start_iter) {
        for (int w = 0; w < ranks; ++w) {
          for (int64_t i = 0; i < numel; ++i) {
            p.error[static_cast<size_t>(w)][static_cast<size_t>(i)] =
                input[static_cast<size_t>(w)][static_cast<size_t>(i)] - result[static_cast<size_t>(i)];
          }
        }
      }
      results.push_back(result);
    }
    out.push_back(results);
  }
  return out;
}


RankRun run_rank(Communicator& comm, int first, int rounds, const PowerSgdOptions& options,
                 const std::map<std::string, Tensor>* load, int64_t bucket_bytes, bool average) {
  RankRun me;
  Params model;
  auto hook = std::make_shared<PowerSgd>(options);
  if (load) hook->load_state_dict(*load);
  DistributedDataParallel ddp(model, comm,
                              {.bucket_bytes = bucket_bytes, .average = average, .comm_hook = hook});
  const std::vector<DistributedDataParallel::BucketInfo> buckets = ddp.buckets();
  me.bucket_names = buckets.at(0).names;
  for (size_t k = 0; k < buckets.size(); ++k) {
    for (size_t j = 0; j < buckets[k].names.size(); ++j) {
      me.places[buckets[k].names[j]] = {static_cast<int>(k), static_cast<int>(j)};
    }
  }
  const nn::NamedTensors params = model.named_parameters();
  for (int t = first; t < first + rounds; ++t) {
    for (size_t k = 0; k < params.size(); ++k) {
      const Tensor& p = params[k].second;
      p.set_grad(Tensor::from_vector<double>(grad_values(comm.rank(), t, k, p.numel()), p.shape()));
    }
    CommLog log;
    {
      CommLogScope scope(log);
      ddp.finish();
    }
    me.round_bytes.push_back(log.bytes({CommKind::gradients}));
    me.traffic.push_back(hook->last_round());
    std::vector<std::vector<double>> g;
    for (const auto& entry : params) g.push_back(entry.second.grad().to_vector<double>());
    me.grads.push_back(g);
  }
  me.state = hook->state_dict();
  return me;
}

double worst_relative(const std::vector<std::vector<std::vector<double>>>& got,
                      const std::vector<std::vector<Mat>>& want) {
  double worst = 0;
  REQUIRE(got.size() == want.size());
  for (size_t t = 0; t < want.size(); ++t) {
    for (size_t k = 0; k < want[t].size(); ++k) {
      const Mat& exp = want[t][k];
      REQUIRE(got[t][k].size() == exp.size());
      double scale = 1e-300;
      for (double x : exp) scale = std::max(scale, std::abs(x));
      for (size_t i = 0; i < exp.size(); ++i) {
        worst = std::max(worst, std::abs(got[t][k][i] - exp[i]) / scale);
      }
    }
  }
  return worst;
}

}  // namespace tessera::parallel::testing_powersgd
