// IDX / MNIST reading (synthetic files, gzipped and plain, plus the real Fashion-MNIST, a
// declared dependency: Debian's dataset-fashion-mnist) and the Loader's order, coverage,
// resume and prefetch guarantees.
#include <doctest/doctest.h>
#include <zlib.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <numeric>
#include <set>
#include <stdexcept>

#include "tests/testing.h"
#include "models/data/idx.h"
#include "models/data/loader.h"
#include "tensor/ops.h"

namespace fs = std::filesystem;
using namespace tessera;
using namespace tessera::data;

namespace {

using testing::error_of;
using testing::contains;

std::string make_temp_dir() {
  const char* root = std::getenv("TEST_TMPDIR");
  std::string tmpl = std::string(root ? root : "/tmp") + "/data_test.XXXXXX";
  REQUIRE(::mkdtemp(tmpl.data()) != nullptr);
  return tmpl;
}

// Magic 0x00 0x00 type ndims, big-endian dims, then the data.
std::string idx_bytes(const std::vector<uint32_t>& dims, const std::string& data,
                      uint8_t type = 0x08) {
  std::string out = {'\0', '\0', static_cast<char>(type), static_cast<char>(dims.size())};
  for (uint32_t d : dims) {
    for (int shift : {24, 16, 8, 0}) out.push_back(static_cast<char>((d >> shift) & 0xff));
  }
  return out + data;
}

void write_plain(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  REQUIRE(out.good());
}

void write_gz(const std::string& path, const std::string& bytes) {
  gzFile f = gzopen(path.c_str(), "wb");
  REQUIRE(f != nullptr);
  REQUIRE(gzwrite(f, bytes.data(), static_cast<unsigned>(bytes.size())) ==
          static_cast<int>(bytes.size()));
  REQUIRE(gzclose(f) == Z_OK);
}

std::string read_plain(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

std::string iota_bytes(size_t n, int start = 0) {
  std::string s(n, '\0');
  for (size_t i = 0; i < n; ++i) s[i] = static_cast<char>((start + i) & 0xff);
  return s;
}

// A synthetic MNIST split: image i has every pixel equal to (i * 37) % 256, label i % 10.
void write_mnist_split(const std::string& dir, const std::string& prefix, uint32_t n, bool gz,
                       uint32_t n_labels = 0) {
  std::string pixels;
  for (uint32_t i = 0; i < n; ++i) pixels.append(28 * 28, static_cast<char>((i * 37) % 256));
  std::string labels;
  for (uint32_t i = 0; i < (n_labels ? n_labels : n); ++i)
    labels.push_back(static_cast<char>(i % 10));
  const std::string ext = gz ? ".gz" : "";
  auto write = gz ? write_gz : write_plain;
  write(dir + "/" + prefix + "-images-idx3-ubyte" + ext, idx_bytes({n, 28, 28}, pixels));
  write(dir + "/" + prefix + "-labels-idx1-ubyte" + ext,
        idx_bytes({static_cast<uint32_t>(labels.size())}, labels));
}

}  // namespace

TEST_CASE("read_idx: valid files, gzipped and plain") {
  const std::string dir = make_temp_dir();
  const std::string bytes = idx_bytes({3, 2, 4}, iota_bytes(24, 250));
  write_plain(dir + "/a", bytes);
  write_gz(dir + "/a.gz", bytes);
  for (const std::string name : {"a", "a.gz"}) {
    CAPTURE(name);
    const IdxArray a = read_idx(dir + "/" + name);
    CHECK(a.dims == std::vector<int64_t>{3, 2, 4});
    REQUIRE(a.data.size() == 24);
    CHECK(a.data[0] == 250);
    CHECK(a.data[5] == 255);
    CHECK(a.data[6] == 0);  // wrapped
    CHECK(a.data[23] == 17);
  }
  // Labels (1 dim), and a dim of zero with no data.
  write_gz(dir + "/l.gz", idx_bytes({5}, "\x01\x02\x03\x04\x05"));
  CHECK(read_idx(dir + "/l.gz").data == std::vector<uint8_t>{1, 2, 3, 4, 5});
  write_plain(dir + "/z", idx_bytes({0, 28, 28}, ""));
  CHECK(read_idx(dir + "/z").dims == std::vector<int64_t>{0, 28, 28});
  CHECK(read_idx(dir + "/z").data.empty());
  // Dims are big-endian: 0x01000002 is 16777218, not 0x02000001.
  write_plain(dir + "/big", idx_bytes({0x01000002u}, "xy"));
  CHECK(contains(error_of([&] { read_idx(dir + "/big"); }), "need 16777218 data bytes, got 2"));
}

TEST_CASE("read_idx: bad magic, truncation and trailing bytes name the file and sizes") {
  const std::string dir = make_temp_dir();
  const std::string p = dir + "/f";
  auto err_plain = [&](const std::string& bytes) {
    write_plain(p, bytes);
    return error_of([&] { read_idx(p); });
  };
  auto err_gz = [&](const std::string& bytes) {
    write_gz(p + ".gz", bytes);
    return error_of([&] { read_idx(p + ".gz"); });
  };

  std::string msg = err_plain(std::string("\x01\x00\x08\x03", 4) + std::string(12, '\0'));
  CHECK(contains(msg, fmt::format("read_idx: '{}' has magic 0x01000803; expected 0x000008NN", p)));
  CHECK(contains(err_plain(idx_bytes({2}, "ab", 0x0D)),
                 "has element type 0x0d (magic 0x00000d01); only unsigned bytes"));
  CHECK(contains(err_plain(std::string("\0\0\x08\0", 4)), "has magic 0x00000800"));
  CHECK(contains(err_plain(std::string(2, '\0')),
                 "holds 2 bytes, too short for the 4-byte IDX magic"));
  CHECK(contains(err_plain(std::string("\0\0\x08\x03\0\0\0\x02\0\0", 10)),
                 "truncated in its header: 3 dims need 12 bytes, got 6"));

  for (const std::function<std::string(const std::string&)>& err :
       {std::function<std::string(const std::string&)>(err_plain),
        std::function<std::string(const std::string&)>(err_gz)}) {
    msg = err(idx_bytes({3, 2, 2}, iota_bytes(10)));
    CHECK(contains(msg, "is truncated: dims [3, 2, 2] need 12 data bytes, got 10"));
    CHECK(contains(msg, "'" + p));
    msg = err(idx_bytes({3, 2, 2}, iota_bytes(15)));
    CHECK(contains(msg, "has 3 extra bytes after the 12 data bytes of dims [3, 2, 2]"));
  }

  // A gzip stream cut short: the bytes that did decompress are counted, then it is truncated.
  write_gz(p + ".gz", idx_bytes({4000}, std::string(4000, '\x07')));
  const std::string gz = read_plain(p + ".gz");
  write_plain(p + "_cut.gz", gz.substr(0, gz.size() - 10));  // drop the CRC/size trailer
  msg = error_of([&] { read_idx(p + "_cut.gz"); });
  CHECK(contains(msg, p + "_cut.gz"));
  CHECK((contains(msg, "truncated") || contains(msg, "not a readable gzip")));
  CHECK(contains(error_of([&] { read_idx(dir + "/missing.gz"); }),
                 "cannot open '" + dir + "/missing.gz'"));
}

TEST_CASE("load_mnist: synthetic MNIST in both file forms, normalised as documented") {
  const std::string dir = make_temp_dir();
  write_mnist_split(dir, "train", 25, /*gz=*/true);
  write_mnist_split(dir, "t10k", 12, /*gz=*/false);

  const MnistSplit train = load_mnist(dir, true, kMnistMean, kMnistStd);
  CHECK(train.images.shape() == Shape{25, 1, 28, 28});
  CHECK(train.images.dtype() == DType::f32);
  CHECK(train.labels.shape() == Shape{25});
  CHECK(train.labels.dtype() == DType::i64);
  const std::vector<float> px = train.images.to_vector<float>();
  const std::vector<int64_t> labels = train.labels.to_vector<int64_t>();
  for (int64_t i : {0, 1, 7, 24}) {
    CAPTURE(i);
    const double want = (((i * 37) % 256) / 255.0 - kMnistMean) / kMnistStd;
    // The table is computed in f64 and rounded once to f32: half an f32 ulp at |x| < 4.
    CHECK(std::abs(px[i * 784] - want) < 3e-7);
    CHECK(px[i * 784 + 783] == px[i * 784]);
    CHECK(labels[i] == i % 10);
  }

  const MnistSplit test = load_mnist(dir, false, 0.0, 1.0, /*limit=*/5);  // plain [0, 1]
  CHECK(test.images.shape() == Shape{5, 1, 28, 28});
  CHECK(test.labels.to_vector<int64_t>() == std::vector<int64_t>{0, 1, 2, 3, 4});
  CHECK(test.images.to_vector<float>()[784] == 37.0f / 255.0f);
  CHECK(load_mnist(dir, false, 0.0, 1.0, /*limit=*/100).images.size(0) == 12);

  // The dotted names some mirrors use.
  const std::string dotted = make_temp_dir();
  fs::copy(dir + "/t10k-images-idx3-ubyte", dotted + "/t10k-images.idx3-ubyte");
  fs::copy(dir + "/t10k-labels-idx1-ubyte", dotted + "/t10k-labels.idx1-ubyte");
  CHECK(load_mnist(dotted, false).labels.size(0) == 12);
}

TEST_CASE("load_mnist: inconsistent files are errors") {
  const std::string dir = make_temp_dir();
  write_mnist_split(dir, "train", 3, true, /*n_labels=*/4);
  CHECK(contains(error_of([&] { load_mnist(dir, true); }),
                 "load_mnist: 3 images in '" + dir + "/train-images-idx3-ubyte.gz' but 4 labels"));
  CHECK(contains(error_of([&] { load_mnist(dir, false); }),
                 "load_mnist: no t10k-images-idx3-ubyte.gz or t10k-images-idx3-ubyte in '" + dir));

  write_gz(dir + "/train-labels-idx1-ubyte.gz", idx_bytes({3}, "\x01\x0c\x02"));
  CHECK(
      contains(error_of([&] { load_mnist(dir, true); }), "has label 12 at index 1; expected 0..9"));

  // Images and labels swapped: the dims give it away.
  write_gz(dir + "/train-images-idx3-ubyte.gz", idx_bytes({3}, "\x01\x02\x03"));
  CHECK(contains(error_of([&] { load_mnist(dir, true); }),
                 "should hold images (magic 0x00000803, dims [N, rows, cols]), got dims [3]"));
  CHECK(contains(error_of([&] { load_mnist(dir, true, 0.5, 0.0); }), "std must be positive"));
}

TEST_CASE("load_mnist: the real Fashion-MNIST") {
  // A declared dependency (tools/setup.sh installs it): missing, the test fails.
  for (const char* file : {"train-images-idx3-ubyte", "train-labels-idx1-ubyte",
                           "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"}) {
    const std::string path = std::string(kFashionMnistDir) + "/" + file;
    REQUIRE_MESSAGE((fs::exists(path + ".gz") || fs::exists(path)),
                    "Fashion-MNIST is not installed: " << path
                        << ".gz is missing; install Debian's dataset-fashion-mnist "
                           "(tools/setup.sh does)");
  }
  for (bool train : {true, false}) {
    CAPTURE(train);
    const MnistSplit s = load_mnist(kFashionMnistDir, train);
    const int64_t n = train ? 60000 : 10000;
    CHECK(s.images.shape() == Shape{n, 1, 28, 28});
    CHECK(s.labels.shape() == Shape{n});
    std::vector<int64_t> histogram(10, 0);
    for (int64_t label : s.labels.to_vector<int64_t>()) histogram.at(label) += 1;
    CHECK(histogram == std::vector<int64_t>(10, n / 10));  // both splits are balanced

    const float* px = s.images.data<float>();
    const int64_t count = s.images.numel();
    const auto [lo, hi] = std::minmax_element(px, px + count);
    CHECK(*lo == static_cast<float>((0.0 - kFashionMnistMean) / kFashionMnistStd));
    CHECK(*hi == static_cast<float>((1.0 - kFashionMnistMean) / kFashionMnistStd));
    if (train) {
      // The documented constants are the training set's statistics (to 4 digits), so the
      // normalised pixels have mean ~0 and std ~1 (population, over all 47M pixels).
      double sum = 0, sum_sq = 0;
      for (int64_t i = 0; i < count; ++i) {
        sum += px[i];
        sum_sq += static_cast<double>(px[i]) * px[i];
      }
      const double mean = sum / count;
      const double sd = std::sqrt(sum_sq / count - mean * mean);
      CHECK(std::abs(mean) < 5e-4);
      CHECK(std::abs(sd - 1.0) < 5e-4);
    }
  }
  const MnistSplit few =
      load_mnist(kFashionMnistDir, false, kFashionMnistMean, kFashionMnistStd, 7);
  CHECK(few.labels.to_vector<int64_t>() ==
        load_mnist(kFashionMnistDir, false).labels.slice(0, 0, 7).to_vector<int64_t>());
}

// ---- Loader ----------------------------------------------------------------------------

namespace {

// inputs row i = {i, i + 0.5, -i}; targets i64 i, so every batch can check its own rows.
struct Toy {
  Tensor inputs, targets;
  explicit Toy(int64_t n) {
    std::vector<float> x;
    std::vector<int64_t> y;
    for (int64_t i = 0; i < n; ++i) {
      x.insert(x.end(), {float(i), float(i) + 0.5f, -float(i)});
      y.push_back(i);
    }
    inputs = Tensor::from_vector(x, {n, 3});
    targets = Tensor::from_vector(y, {n});
  }
};

std::vector<int64_t> targets_of(const Batch& b) { return b.targets.to_vector<int64_t>(); }

void check_rows_match(const Batch& b) {
  const std::vector<float> x = b.inputs.to_vector<float>();
  const std::vector<int64_t> y = targets_of(b);
  REQUIRE(x.size() == 3 * y.size());
  for (size_t r = 0; r < y.size(); ++r) {
    CHECK(x[3 * r] == float(y[r]));
    CHECK(x[3 * r + 1] == float(y[r]) + 0.5f);
    CHECK(x[3 * r + 2] == -float(y[r]));
  }
}

// Targets of the next `count` batches (epoch ends are skipped), with their positions.
struct Delivered {
  std::vector<std::vector<int64_t>> targets;
  std::vector<std::pair<int64_t, int64_t>> positions;
  bool operator==(const Delivered&) const = default;
};
Delivered take(Loader& loader, int count) {
  Delivered d;
  Batch b;
  while (static_cast<int>(d.targets.size()) < count) {
    if (!loader.next(b)) continue;
    check_rows_match(b);
    d.targets.push_back(targets_of(b));
    d.positions.emplace_back(b.epoch, b.index);
  }
  return d;
}

}  // namespace

TEST_CASE("Loader: every sample exactly once per epoch, then false and the next epoch") {
  Toy toy(10);
  for (int prefetch : {0, 2}) {
    CAPTURE(prefetch);
    Loader loader(toy.inputs, toy.targets, {.batch_size = 4, .seed = 3, .prefetch = prefetch});
    CHECK(loader.batches_per_epoch() == 3);
    CHECK(loader.num_samples() == 10);
    for (int64_t epoch = 0; epoch < 3; ++epoch) {
      std::vector<int64_t> seen;
      Batch b;
      for (int64_t i = 0; i < 3; ++i) {
        CHECK(loader.epoch() == epoch);
        CHECK(loader.batch_index() == i);
        REQUIRE(loader.next(b));
        CHECK(b.epoch == epoch);
        CHECK(b.index == i);
        CHECK(b.inputs.shape() == Shape{i < 2 ? 4 : 2, 3});
        CHECK(b.inputs.is_contiguous());
        check_rows_match(b);
        for (int64_t t : targets_of(b)) seen.push_back(t);
      }
      CHECK(seen == loader.permutation(epoch));
      std::sort(seen.begin(), seen.end());
      CHECK(seen == std::vector<int64_t>{0, 1, 2, 3, 4, 5, 6, 7, 8, 9});
      CHECK(loader.batch_index() == 3);
      CHECK_FALSE(loader.next(b));
      CHECK(loader.epoch() == epoch + 1);
      CHECK(loader.batch_index() == 0);
    }
  }
}

TEST_CASE("Loader: the order is a pure function of (seed, epoch)") {
  Toy toy(1000);
  Loader a(toy.inputs, toy.targets, {.batch_size = 100, .seed = 7});
  Loader b(toy.inputs, toy.targets, {.batch_size = 33, .seed = 7, .prefetch = 0});
  Loader c(toy.inputs, toy.targets, {.batch_size = 100, .seed = 8});
  for (int64_t e : {0, 1, 5}) {
    const std::vector<int64_t> p = a.permutation(e);
    CHECK(p == b.permutation(e));  // the batch size does not enter
    CHECK(p != c.permutation(e));
    std::vector<int64_t> sorted = p;
    std::sort(sorted.begin(), sorted.end());
    std::vector<int64_t> identity(1000);
    std::iota(identity.begin(), identity.end(), 0);
    CHECK(sorted == identity);
    CHECK(p != identity);
    // A random permutation of 1000 has about one fixed point; a broken shuffle has many.
    int fixed = 0;
    for (int64_t i = 0; i < 1000; ++i) fixed += p[i] == i;
    CHECK(fixed < 10);
  }
  CHECK(a.permutation(0) != a.permutation(1));
  Loader d(toy.inputs, toy.targets, {.batch_size = 100, .seed = 7});
  Loader e(toy.inputs, toy.targets, {.batch_size = 100, .seed = 7});
  CHECK(take(d, 25) == take(e, 25));

  Loader plain(toy.inputs, toy.targets, {.batch_size = 300, .shuffle = false});
  Delivered p = take(plain, 5);
  CHECK(p.targets[0].front() == 0);
  CHECK(p.targets[3].size() == 100);
  CHECK(p.targets[3].back() == 999);
  CHECK(p.targets[4] == p.targets[0]);  // same order every epoch
}

TEST_CASE("Loader: drop_last") {
  Toy toy(10);
  Loader keep(toy.inputs, toy.targets, {.batch_size = 4, .drop_last = false});
  Loader drop(toy.inputs, toy.targets, {.batch_size = 4, .drop_last = true});
  CHECK(keep.batches_per_epoch() == 3);
  CHECK(drop.batches_per_epoch() == 2);
  const Delivered k = take(keep, 3), d = take(drop, 4);
  CHECK(k.targets[2].size() == 2);
  CHECK(d.targets[0] == k.targets[0]);  // same order; only the tail is dropped
  CHECK(d.targets[1] == k.targets[1]);
  CHECK(d.positions == std::vector<std::pair<int64_t, int64_t>>{{0, 0}, {0, 1}, {1, 0}, {1, 1}});
  std::set<int64_t> distinct;
  for (int i = 0; i < 2; ++i) distinct.insert(d.targets[i].begin(), d.targets[i].end());
  CHECK(distinct.size() == 8);
  Loader exact(toy.inputs, toy.targets, {.batch_size = 5, .drop_last = true});
  CHECK(exact.batches_per_epoch() == 2);  // nothing to drop
}

TEST_CASE("Loader: set_position resumes exactly where an uninterrupted loader is") {
  Toy toy(50);
  const LoaderOptions options{.batch_size = 8, .seed = 11};  // 7 batches, last of 2
  Loader reference(toy.inputs, toy.targets, options);
  const Delivered all = take(reference, 30);
  for (int stop_after : {0, 3, 7, 9, 14, 20}) {
    CAPTURE(stop_after);
    int64_t epoch = 0, index = 0;
    {
      Loader first(toy.inputs, toy.targets, options);
      take(first, stop_after);  // its prefetch thread ran ahead; destroying it must not hang
      epoch = first.epoch();
      index = first.batch_index();
    }
    for (int prefetch : {0, 3}) {
      LoaderOptions o = options;
      o.prefetch = prefetch;
      Loader resumed(toy.inputs, toy.targets, o);
      take(resumed, 2);  // somewhere else, with batches queued
      resumed.set_position(epoch, index);
      const Delivered rest = take(resumed, 30 - stop_after);
      CHECK(rest.targets ==
            std::vector<std::vector<int64_t>>(all.targets.begin() + stop_after, all.targets.end()));
      CHECK(rest.positions.front() == all.positions[stop_after]);
    }
  }
  // The end-of-epoch position (index == batches_per_epoch) resumes into the next epoch.
  Loader at_end(toy.inputs, toy.targets, options);
  at_end.set_position(0, 7);
  Batch b;
  CHECK_FALSE(at_end.next(b));
  REQUIRE(at_end.next(b));
  CHECK(targets_of(b) == all.targets[7]);
  CHECK(b.epoch == 1);
  CHECK(b.index == 0);
}

TEST_CASE("Loader: prefetch depth does not change the batches") {
  Toy toy(37);
  std::vector<Delivered> runs;
  for (int prefetch : {0, 1, 2, 16}) {
    Loader loader(toy.inputs, toy.targets, {.batch_size = 5, .seed = 2, .prefetch = prefetch});
    runs.push_back(take(loader, 40));  // 8 batches per epoch: 5 epochs
  }
  for (size_t i = 1; i < runs.size(); ++i) CHECK(runs[i] == runs[0]);

  // Non-contiguous inputs are gathered by their logical rows; i32 targets [N, 1].
  const Tensor base = arange(0, 4 * 6, 1, DType::f32).reshape({4, 6}).t();  // [6, 4] view
  REQUIRE(!base.is_contiguous());
  const Tensor targets = arange(0, 6, 1, DType::i32).reshape({6, 1});
  Loader loader(base, targets, {.batch_size = 4, .shuffle = false, .prefetch = 1});
  Batch b;
  REQUIRE(loader.next(b));
  CHECK(b.inputs.shape() == Shape{4, 4});
  CHECK(b.inputs.to_vector<float>() == base.slice(0, 0, 4).to_vector<float>());
  CHECK(b.targets.shape() == Shape{4, 1});
  CHECK(b.targets.to_vector<int32_t>() == std::vector<int32_t>{0, 1, 2, 3});
  REQUIRE(loader.next(b));
  CHECK(b.inputs.to_vector<float>() == base.slice(0, 4, 6).to_vector<float>());
}

TEST_CASE("Loader: an error while assembling is rethrown at its batch, position unchanged") {
  Toy toy(20);
  for (int prefetch : {0, 2}) {
    CAPTURE(prefetch);
    std::atomic<int> calls = 0;  // bumped on the prefetch thread
    LoaderOptions o{.batch_size = 4, .seed = 1, .prefetch = prefetch};
    o.transform = [&calls](Batch& b) {
      ++calls;
      if (b.epoch == 0 && b.index == 2) throw Error("transform: bad batch (0, 2)");
      b.inputs = b.inputs * 2.0;
    };
    Loader loader(toy.inputs, toy.targets, o);
    Batch b;
    REQUIRE(loader.next(b));
    REQUIRE(loader.next(b));
    const std::vector<int64_t> y = targets_of(b);
    CHECK(b.inputs.to_vector<float>()[0] == 2.0f * float(y[0]));  // transform applied
    CHECK_THROWS_WITH_AS(loader.next(b), "transform: bad batch (0, 2)", Error);
    CHECK(loader.epoch() == 0);
    CHECK(loader.batch_index() == 2);
    CHECK_THROWS_WITH_AS(loader.next(b), "transform: bad batch (0, 2)", Error);  // retried
    loader.set_position(0, 3);                                                   // skip it
    REQUIRE(loader.next(b));
    CHECK(b.index == 3);
    CHECK(calls >= 4);
  }
}

TEST_CASE("Loader: distributed sampling, each rank's slices concatenate to the one-rank batch") {
  Toy toy(10);
  for (int world : {2, 3, 4}) {
    CAPTURE(world);
    Loader one(toy.inputs, toy.targets, {.batch_size = 4, .seed = 5});
    std::vector<std::unique_ptr<Loader>> ranks;
    for (int r = 0; r < world; ++r) {
      ranks.push_back(std::make_unique<Loader>(
          toy.inputs, toy.targets, LoaderOptions{.batch_size = 4, .seed = 5, .rank = r, .world = world}));
      CHECK(ranks.back()->batches_per_epoch() == one.batches_per_epoch());
    }
    for (int64_t step = 0; step < 2 * one.batches_per_epoch(); ++step) {
      Batch want;
      if (!one.next(want)) REQUIRE(one.next(want));
      std::vector<int64_t> got;
      int64_t max_rows = 0, min_rows = 1 << 30;
      for (auto& loader : ranks) {
        Batch b;
        if (!loader->next(b)) REQUIRE(loader->next(b));
        CHECK(b.epoch == want.epoch);
        CHECK(b.index == want.index);
        check_rows_match(b);
        for (int64_t t : targets_of(b)) got.push_back(t);
        max_rows = std::max(max_rows, b.inputs.size(0));
        min_rows = std::min(min_rows, b.inputs.size(0));
      }
      CHECK(got == targets_of(want));
      CHECK(max_rows - min_rows <= 1);  // array_split blocks
    }
  }
  CHECK(contains(error_of([&] {
                   Loader(toy.inputs, toy.targets, {.batch_size = 4, .rank = 2, .world = 2});
                 }),
                 "rank 2 of world 2 is not a rank"));
}

TEST_CASE("Loader: invalid arguments") {
  Toy toy(10);
  CHECK(contains(error_of([&] { Loader(toy.inputs, toy.targets.slice(0, 0, 9)); }),
                 "Loader: inputs [10, 3] and targets [9] hold different numbers of samples"));
  CHECK(contains(error_of([&] { Loader(toy.inputs, toy.targets, {.batch_size = 0}); }),
                 "batch_size must be positive, got 0"));
  CHECK(contains(
      error_of([&] { Loader(toy.inputs, toy.targets, {.batch_size = 11, .drop_last = true}); }),
      "10 samples with batch_size 11 and drop_last give no batches"));
  Loader loader(toy.inputs, toy.targets, {.batch_size = 4});
  CHECK(contains(error_of([&] { loader.set_position(0, 4); }), "batch_index 4 outside [0, 3]"));
  CHECK(contains(error_of([&] { loader.set_position(-1, 0); }), "epoch must be in [0, 2^32)"));
}
