// IDX files (the MNIST / Fashion-MNIST container) and the MNIST-format loaders built on them.
// gzip-compressed and plain files read alike (zlib's gzread passes plain bytes through).
//
//   IdxArray a = read_idx("/data/train-labels-idx1-ubyte.gz");   // dims {60000}, 60000 bytes
//   MnistSplit train = load_mnist(kFashionMnistDir, /*train=*/true);
//   // train.images: f32 [60000, 1, 28, 28], (pixel/255 - 0.2860) / 0.3530
//   // train.labels: i64 [60000], values 0..9
//   MnistSplit test = load_mnist("/data/mnist", false, kMnistMean, kMnistStd, /*limit=*/1000);
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "tensor/tensor.h"

namespace tessera::data {

// Where tools/setup.sh installs Fashion-MNIST (the four *-ubyte.gz files).
inline constexpr const char* kFashionMnistDir = "/usr/share/datasets/fashion-mnist";

// Per-pixel mean and standard deviation of each training set after scaling to [0, 1]; the
// usual constants (torchvision examples), recomputed by tests/models/data_test.cc for
// Fashion-MNIST.
inline constexpr double kFashionMnistMean = 0.2860;
inline constexpr double kFashionMnistStd = 0.3530;
inline constexpr double kMnistMean = 0.1307;
inline constexpr double kMnistStd = 0.3081;

// An unsigned-byte IDX array: magic 0x00 0x00 0x08 ndims, ndims big-endian u32 dims, then
// prod(dims) bytes in row-major order.
struct IdxArray {
  std::vector<int64_t> dims;
  std::vector<uint8_t> data;
};

// Reads and validates an IDX file of unsigned bytes (type 0x08), gzipped or not: the magic,
// the dims, and that exactly prod(dims) data bytes follow (no fewer, no more).
IdxArray read_idx(const std::string& path);

struct MnistSplit {
  Tensor images;  // f32 [N, 1, rows, cols] (28 x 28 for MNIST), (pixel/255 - mean) / std
  Tensor labels;  // i64 [N], each in [0, 10)
};

// Loads {train,t10k}-{images-idx3,labels-idx1}-ubyte from `dir`, with or without .gz
// (the .gz file is preferred when both exist). mean/std default to Fashion-MNIST's; pass
// kMnistMean/kMnistStd for the original MNIST, or 0 and 1 for plain [0, 1] pixels.
// limit >= 0 keeps the first `limit` examples (fast tests); -1 keeps all.
MnistSplit load_mnist(const std::string& dir = kFashionMnistDir, bool train = true,
                      double mean = kFashionMnistMean, double std = kFashionMnistStd,
                      int64_t limit = -1);

}  // namespace tessera::data
