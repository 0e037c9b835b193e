// Byte-level text data: loading (the real fortunes corpus, and a temp dir with the files a
// directory walk must skip), the 90/10 split, and TextWindows' determinism, shifted targets
// and distributed slices that concatenate to the single-rank batch.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include "models/data/text.h"
#include "tests/testing.h"

namespace fs = std::filesystem;
using namespace tessera;
using namespace tessera::data;

namespace {

using testing::contains;
using testing::error_of;

std::string make_temp_dir() {
  const char* root = std::getenv("TEST_TMPDIR");
  std::string tmpl = std::string(root ? root : "/tmp") + "/text_data_test.XXXXXX";
  REQUIRE(::mkdtemp(tmpl.data()) != nullptr);
  return tmpl;
}

void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  REQUIRE(out.good());
}

// The fortunes corpus, loaded once: tools/setup.sh installs it, so its absence is a failure.
const TextCorpus& fortunes() {
  static const TextCorpus corpus = [] {
    if (!fs::is_directory(kFortunesDir)) {
      FAIL("missing " << kFortunesDir
                      << ": install Debian's fortunes package (tools/setup.sh does)");
    }
    return load_text(kFortunesDir);
  }();
  return corpus;
}

// Rows of an i64 [rows, context] tensor as vectors.
std::vector<std::vector<int64_t>> rows_of(const Tensor& t) {
  REQUIRE(t.dim() == 2);
  const std::vector<int64_t> v = t.to_vector<int64_t>();
  std::vector<std::vector<int64_t>> rows;
  for (int64_t r = 0; r < t.size(0); ++r) {
    rows.emplace_back(v.begin() + r * t.size(1), v.begin() + (r + 1) * t.size(1));
  }
  return rows;
}

}  // namespace

TEST_CASE("load_text: the fortunes directory holds its text files only") {
  const TextCorpus& corpus = fortunes();
  // What the loader should keep, listed independently: regular files, no .dat, no symlinks.
  std::vector<std::string> expected;
  int64_t expected_bytes = 0;
  for (const auto& e : fs::directory_iterator(kFortunesDir)) {
    if (e.is_symlink() || !e.is_regular_file() || e.path().extension() == ".dat") continue;
    expected.push_back(e.path().string());
    expected_bytes += static_cast<int64_t>(e.file_size());
  }
  std::sort(expected.begin(), expected.end());
  REQUIRE(corpus.files.size() == expected.size());
  int64_t sum = 0;
  for (size_t i = 0; i < expected.size(); ++i) {
    CHECK(corpus.files[i].path == expected[i]);
    CHECK(fs::path(corpus.files[i].path).extension() != ".dat");
    CHECK(fs::path(corpus.files[i].path).extension() != ".u8");
    CHECK(corpus.files[i].bytes == static_cast<int64_t>(fs::file_size(expected[i])));
    sum += corpus.files[i].bytes;
  }
  CHECK(sum == expected_bytes);
  CHECK(static_cast<int64_t>(corpus.bytes.size()) == expected_bytes);
  CHECK(corpus.bytes.size() > 1'000'000);  // ~2.5 MB on Debian 12
  MESSAGE("fortunes: " << corpus.files.size() << " files, " << corpus.bytes.size() << " bytes");
  // The first file's text opens the concatenation.
  std::ifstream first(corpus.files[0].path, std::ios::binary);
  std::string head(64, '\0');
  first.read(head.data(), 64);
  CHECK(std::equal(head.begin(), head.end(), corpus.bytes.begin(),
                   [](char a, uint8_t b) { return static_cast<uint8_t>(a) == b; }));
  // No strfile index: those hold NUL bytes, the text does not.
  CHECK(std::find(corpus.bytes.begin(), corpus.bytes.end(), 0) == corpus.bytes.end());
}

TEST_CASE("split: first 90% train, last 10% val, adding up to the corpus") {
  const TextCorpus& corpus = fortunes();
  const int64_t n = static_cast<int64_t>(corpus.bytes.size());
  TextWindows train(corpus, TextSplit::train), val(corpus, TextSplit::val);
  CHECK(train.size() + val.size() == n);
  CHECK(train.size() == split_point(n));
  CHECK(train.size() == static_cast<int64_t>(0.9 * n));
  CHECK(std::equal(train.bytes().begin(), train.bytes().end(), corpus.bytes.begin()));
  CHECK(std::equal(val.bytes().begin(), val.bytes().end(), corpus.bytes.begin() + train.size()));
  CHECK(split_point(10) == 9);
  CHECK(split_point(0) == 0);
}

TEST_CASE("TextWindows::get: shapes, byte range, shifted targets, window starts") {
  const TextWindows train(fortunes(), TextSplit::train, /*seed=*/7);
  const int64_t batch = 8, context = 64;
  const TextBatch b = train.get(3, batch, context);
  CHECK(b.idx.dtype() == DType::i64);
  CHECK(b.targets.dtype() == DType::i64);
  CHECK(b.idx.shape() == Shape{batch, context});
  CHECK(b.targets.shape() == Shape{batch, context});
  const auto idx = rows_of(b.idx), targets = rows_of(b.targets);
  for (int64_t r = 0; r < batch; ++r) {
    const int64_t start = train.window_start(3, r, context);
    REQUIRE(start >= 0);
    REQUIRE(start + context + 1 <= train.size());
    for (int64_t t = 0; t < context; ++t) {
      CHECK(idx[r][t] >= 0);
      CHECK(idx[r][t] < kByteVocab);
      CHECK(idx[r][t] == train.bytes()[start + t]);
      CHECK(targets[r][t] == train.bytes()[start + t + 1]);
      if (t + 1 < context) CHECK(targets[r][t] == idx[r][t + 1]);
    }
  }
}

TEST_CASE("TextWindows::get: a pure function of (seed, split, step, row)") {
  const TextCorpus& corpus = fortunes();
  const TextWindows a(corpus, TextSplit::train, 1), b(corpus, TextSplit::train, 1);
  const TextWindows other_seed(corpus, TextSplit::train, 2);
  const int64_t batch = 4, context = 32;
  const auto s5 = rows_of(a.get(5, batch, context).idx);
  CHECK(rows_of(a.get(5, batch, context).idx) == s5);  // same object, again
  CHECK(rows_of(b.get(5, batch, context).idx) == s5);  // another object, same seed
  CHECK(rows_of(a.get(6, batch, context).idx) != s5);
  CHECK(rows_of(other_seed.get(5, batch, context).idx) != s5);
  // A row's window does not depend on the batch size it is drawn in.
  const auto wide = rows_of(a.get(5, 2 * batch, context).idx);
  CHECK(std::vector(wide.begin(), wide.begin() + batch) == s5);
  // Train and val draw from different streams: with equal-size bytes the starts differ.
  const std::vector<uint8_t> same(1000, 'x');
  const TextWindows t(same, TextSplit::train, 1), v(same, TextSplit::val, 1);
  std::set<int64_t> train_starts, val_starts;
  for (int64_t r = 0; r < 16; ++r) {
    train_starts.insert(t.window_start(0, r, 10));
    val_starts.insert(v.window_start(0, r, 10));
  }
  CHECK(train_starts != val_starts);
  CHECK(train_starts.size() > 8);  // spread out, not stuck
}

TEST_CASE("TextWindows::get: rank slices concatenate to the world = 1 batch") {
  const TextWindows train(fortunes(), TextSplit::train, 11);
  const int64_t batch = 8, context = 16, step = 42;
  const auto whole_idx = rows_of(train.get(step, batch, context).idx);
  const auto whole_targets = rows_of(train.get(step, batch, context).targets);
  for (int world : {1, 2, 4}) {
    CAPTURE(world);
    std::vector<std::vector<int64_t>> idx, targets;
    for (int rank = 0; rank < world; ++rank) {
      const TextBatch mine = train.get(step, batch, context, rank, world);
      CHECK(mine.idx.shape() == Shape{batch / world, context});
      for (auto& row : rows_of(mine.idx)) idx.push_back(row);
      for (auto& row : rows_of(mine.targets)) targets.push_back(row);
    }
    CHECK(idx == whole_idx);
    CHECK(targets == whole_targets);
  }
}

TEST_CASE("TextWindows::eval_batch: consecutive windows, sliced by rank") {
  std::vector<uint8_t> bytes(103);
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<uint8_t>(i);
  const TextWindows val(bytes, TextSplit::val);
  // (103 - 1) / 10 = 10 windows, 2 full batches of 4.
  CHECK(val.num_eval_batches(4, 10) == 2);
  const auto idx = rows_of(val.eval_batch(1, 4, 10).idx);
  const auto targets = rows_of(val.eval_batch(1, 4, 10).targets);
  for (int64_t r = 0; r < 4; ++r) {
    for (int64_t t = 0; t < 10; ++t) {
      CHECK(idx[r][t] == (4 + r) * 10 + t);
      CHECK(targets[r][t] == (4 + r) * 10 + t + 1);
    }
  }
  const auto rank1 = rows_of(val.eval_batch(1, 4, 10, /*rank=*/1, /*world=*/2).idx);
  CHECK(rank1 == std::vector(idx.begin() + 2, idx.end()));
  CHECK(contains(error_of([&] { val.eval_batch(2, 4, 10); }), "index 2 outside [0, 2)"));
}

TEST_CASE("load_text: a directory walk keeps text files, skipping .dat, links and binary") {
  const std::string dir = make_temp_dir();
  write_file(dir + "/b.txt", "second\n");
  write_file(dir + "/a", "first\n");
  write_file(dir + "/a.dat", std::string("\0\0\0\2index", 9));
  write_file(dir + "/blob.bin", std::string("PK\0\0zip", 7));
  fs::create_symlink(dir + "/a", dir + "/a.u8");
  fs::create_directory(dir + "/sub");
  write_file(dir + "/sub/c", "third\n");
  fs::create_directory_symlink(dir + "/sub", dir + "/sub_link");

  const TextCorpus corpus = load_text(dir);
  REQUIRE(corpus.files.size() == 3);
  CHECK(corpus.files[0].path == dir + "/a");
  CHECK(corpus.files[1].path == dir + "/b.txt");
  CHECK(corpus.files[2].path == dir + "/sub/c");
  CHECK(corpus.files[0].bytes == 6);
  CHECK(std::string(corpus.bytes.begin(), corpus.bytes.end()) == "first\nsecond\nthird\n");

  // A file named directly is read as it is, even a .dat.
  const TextCorpus one = load_text(dir + "/a.dat");
  CHECK(one.files.size() == 1);
  CHECK(one.bytes.size() == 9);

  // Nothing usable: an error naming the directory.
  const std::string empty = make_temp_dir();
  write_file(empty + "/x.dat", "index");
  CHECK(contains(error_of([&] { load_text(empty); }), "load_text: no text in directory " + empty));
  fs::remove_all(dir);
  fs::remove_all(empty);
}

TEST_CASE("errors: missing path, too-long context, bad slicing") {
  CHECK(contains(error_of([] { load_text("/no/such/text"); }),
                 "load_text: /no/such/text does not exist"));
  const std::vector<uint8_t> bytes(100, 'a');
  const TextWindows w(bytes, TextSplit::train);
  CHECK(w.size() == 100);
  CHECK(contains(error_of([&] { w.get(0, 2, 100); }),
                 "TextWindows::get: context 100 must be in [1, 100)"));
  CHECK(error_of([&] { w.get(0, 2, 99); }).empty());  // the longest window: starts at 0 only
  CHECK(w.window_start(0, 1, 99) == 0);
  CHECK(contains(error_of([&] { w.get(0, 6, 8, 0, 4); }),
                 "global batch 6 is not divisible by world 4"));
  CHECK(contains(error_of([&] { w.get(0, 8, 8, 4, 4); }), "rank 4 outside [0, 4)"));
  CHECK(contains(error_of([&] { w.get(-1, 8, 8); }), "step -1 outside"));
  CHECK(contains(error_of([&] { TextWindows(std::vector<uint8_t>(1), TextSplit::val); }),
                 "the val split holds 1 bytes"));
}
