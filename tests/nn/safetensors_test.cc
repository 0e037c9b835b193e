// Safetensors: bitwise round trips, the on-disk layout byte by byte, every malformed-file
// error, atomic saves, and a cross-check by an independent Python reader (PyTorch: Debian's
// python3-torch, a declared dependency, so the test fails without it).
#include "nn/safetensors.h"

#include <doctest/doctest.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "tensor/ops.h"

namespace fs = std::filesystem;
using nlohmann::json;
using namespace tessera;
using tessera::nn::load_safetensors;
using tessera::nn::save_safetensors;

namespace {

// A fresh directory per test case under Bazel's TEST_TMPDIR (or /tmp when run by hand).
std::string make_temp_dir() {
  const char* root = std::getenv("TEST_TMPDIR");
  std::string tmpl = std::string(root ? root : "/tmp") + "/safetensors_test.XXXXXX";
  REQUIRE(::mkdtemp(tmpl.data()) != nullptr);
  return tmpl;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  REQUIRE(in.good());
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  REQUIRE(out.good());
}

// The tensor's values in logical order as the raw bytes of its dtype.
std::string host_bytes(const Tensor& t) {
  std::string out(static_cast<size_t>(t.nbytes()), '\0');
  copy_to_host(t, t.dtype(), out.data());
  return out;
}

// A file with `header` (padded with spaces to 8 bytes) and `data` exactly as given.
std::string raw_file(std::string header, const std::string& data) {
  header.append((8 - header.size() % 8) % 8, ' ');
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((header.size() >> (8 * i)) & 0xff);
  return out + header + data;
}

// Loads `bytes` from a file and returns the Error message ("" if it loaded).
std::string load_error(const std::string& dir, const std::string& bytes) {
  const std::string path = dir + "/bad.safetensors";
  write_file(path, bytes);
  try {
    load_safetensors(path);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

bool contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

// One tensor of every dtype, including the values most likely to be mangled on the way.
std::map<std::string, Tensor> every_dtype() {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::map<std::string, Tensor> t;
  t["f32"] = Tensor::from_vector<float>({1.5f, -0.0f, inf, nan, 1e-45f, -3.25e38f}, {2, 3});
  t["f64"] = Tensor::from_vector<double>({0.1, -2.0, 5e-324, 1e308}, {4});
  t["f16"] = Tensor::from_vector<Half>(
      {Half(0.1f), Half(-65504.0f), Half::from_bits(0x0001), Half::from_bits(0x7e00)}, {2, 2});
  t["bf16"] = Tensor::from_vector<BFloat16>(
      {BFloat16(3.14159f), BFloat16(-1e30f), BFloat16::from_bits(0x0001)}, {3, 1});
  t["i32"] = Tensor::from_vector<int32_t>({0, -1, std::numeric_limits<int32_t>::min(), 7}, {4});
  t["i64"] = Tensor::from_vector<int64_t>(
      {std::numeric_limits<int64_t>::max(), -5, (int64_t{1} << 60) + 1}, {1, 3});
  t["bool"] = Tensor::from_vector<bool>({true, false, false, true, true}, {5});
  t["scalar"] = Tensor::from_vector<double>({-7.25}, {});  // 0-d
  t["empty"] = Tensor::empty({0, 4}, DType::f32);          // no data
  t["empty_bf16"] = Tensor::empty({3, 0}, DType::bf16);
  return t;
}

}  // namespace

TEST_CASE("safetensors: every dtype, 0-d and empty tensors round-trip bitwise") {
  const std::string dir = make_temp_dir();
  const std::string path = dir + "/all.safetensors";
  const auto tensors = every_dtype();
  save_safetensors(path, tensors);
  const auto loaded = load_safetensors(path);
  REQUIRE(loaded.tensors.size() == tensors.size());
  CHECK(loaded.metadata.empty());
  // Plain variables, not a structured binding: CAPTURE captures them (clang < 16 rejects that).
  for (const auto& entry : tensors) {
    const std::string& name = entry.first;
    const Tensor& t = entry.second;
    CAPTURE(name);
    const Tensor& u = loaded.tensors.at(name);
    CHECK(u.dtype() == t.dtype());
    CHECK(u.shape() == t.shape());
    // Only with data: Tensor::is_contiguous() reports false for fresh tensors with a 0 dim
    // (e.g. [3, 0]), which has no bearing on the bytes.
    if (u.numel() > 0) CHECK(u.is_contiguous());
    CHECK(u.device() == kCPU);
    CHECK(host_bytes(u) == host_bytes(t));  // NaN payloads, -0 and subnormals included
  }
  CHECK(loaded.tensors.at("scalar").dim() == 0);
  CHECK(loaded.tensors.at("scalar").item<double>() == -7.25);
  CHECK(loaded.tensors.at("i64").to_vector<int64_t>()[2] == (int64_t{1} << 60) + 1);
  CHECK(loaded.tensors.at("bool").to_vector<bool>() ==
        std::vector<bool>{true, false, false, true, true});
}

TEST_CASE("safetensors: metadata round-trips, including unicode and empty values") {
  const std::string dir = make_temp_dir();
  const std::string path = dir + "/meta.safetensors";
  const std::map<std::string, std::string> meta = {
      {"format", "pt"}, {"step", "1200"}, {"note", "λ = 0.1, \"quoted\"\nnewline"}, {"empty", ""}};
  save_safetensors(path, {{"w", ones({2})}}, meta);
  const auto loaded = load_safetensors(path);
  CHECK(loaded.metadata == meta);
  CHECK(loaded.tensors.at("w").to_vector<float>() == std::vector<float>{1.0f, 1.0f});

  // No tensors at all is a valid file too.
  save_safetensors(path, {}, {{"only", "metadata"}});
  const auto bare = load_safetensors(path);
  CHECK(bare.tensors.empty());
  CHECK(bare.metadata.at("only") == "metadata");
}

TEST_CASE("safetensors: the bytes on disk follow the format") {
  const std::string dir = make_temp_dir();
  const std::string path = dir + "/layout.safetensors";
  const Tensor a = Tensor::from_vector<float>({1, 2, 3, 4, 5, 6}, {2, 3});
  const Tensor b = Tensor::from_vector<int64_t>({-1, 1 << 20}, {2});
  const Tensor c = Tensor::from_vector<BFloat16>({BFloat16(1.0f)}, {});
  save_safetensors(path, {{"b", b}, {"a", a}, {"c", c}}, {{"k", "v"}});
  const std::string file = read_file(path);

  uint64_t n = 0;
  for (int i = 0; i < 8; ++i)
    n |= static_cast<uint64_t>(static_cast<unsigned char>(file[i])) << (8 * i);
  CHECK(n % 8 == 0);  // data starts 8-byte aligned
  REQUIRE(8 + n <= file.size());
  const std::string header = file.substr(8, n);
  CHECK(header.front() == '{');
  // Padding is spaces only, after the JSON's closing brace.
  const size_t close = header.rfind('}');
  CHECK(header.find_first_not_of(' ', close + 1) == std::string::npos);
  CHECK(header.size() - close - 1 < 8);

  const json h = json::parse(header);
  CHECK(h.size() == 4);
  CHECK(h["__metadata__"] == json{{"k", "v"}});
  CHECK(h["a"]["dtype"] == "F32");
  CHECK(h["a"]["shape"] == json::array({2, 3}));
  CHECK(h["b"]["dtype"] == "I64");
  CHECK(h["b"]["shape"] == json::array({2}));
  CHECK(h["c"]["dtype"] == "BF16");
  CHECK(h["c"]["shape"] == json::array());
  // Back to back in name order: a (24 bytes), b (16), c (2).
  CHECK(h["a"]["data_offsets"] == json::array({0, 24}));
  CHECK(h["b"]["data_offsets"] == json::array({24, 40}));
  CHECK(h["c"]["data_offsets"] == json::array({40, 42}));
  CHECK(file.size() == 8 + n + 42);

  const std::string data = file.substr(8 + n);
  float a_values[6];
  std::memcpy(a_values, data.data(), 24);
  CHECK(a_values[0] == 1.0f);
  CHECK(a_values[5] == 6.0f);
  // Little-endian i64 -1 then 2^20, spelled out byte by byte.
  CHECK(data.substr(24, 8) == std::string(8, '\xff'));
  CHECK(data.substr(32, 8) == std::string("\x00\x00\x10\x00\x00\x00\x00\x00", 8));
  CHECK(data.substr(40, 2) == std::string("\x80\x3f", 2));  // bf16 1.0 = 0x3f80
}

TEST_CASE("safetensors: non-contiguous inputs are saved by their logical values") {
  const std::string dir = make_temp_dir();
  const std::string path = dir + "/views.safetensors";
  const Tensor base = arange(0, 12, 1, DType::f32).reshape({3, 4});
  const Tensor transposed = base.t();             // [4, 3], strides {1, 4}
  const Tensor stepped = base.slice(1, 0, 4, 2);  // [3, 2], every other column
  const Tensor expanded = Tensor::from_vector<int32_t>({9}, {1}).expand({4});  // stride 0
  REQUIRE(!transposed.is_contiguous());
  REQUIRE(!stepped.is_contiguous());
  save_safetensors(path, {{"t", transposed}, {"s", stepped}, {"e", expanded}});
  const auto loaded = load_safetensors(path);
  CHECK(loaded.tensors.at("t").shape() == Shape{4, 3});
  CHECK(loaded.tensors.at("t").to_vector<float>() ==
        std::vector<float>{0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11});
  CHECK(loaded.tensors.at("s").to_vector<float>() == std::vector<float>{0, 2, 4, 6, 8, 10});
  CHECK(loaded.tensors.at("e").to_vector<int32_t>() == std::vector<int32_t>{9, 9, 9, 9});
}

TEST_CASE("safetensors: truncated files fail with a message saying where") {
  const std::string dir = make_temp_dir();
  const std::string good = dir + "/good.safetensors";
  save_safetensors(good, {{"x", arange(0, 10, 1, DType::f64)}, {"y", ones({3}, DType::i32)}});
  const std::string file = read_file(good);
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i)
    n |= static_cast<uint64_t>(static_cast<unsigned char>(file[i])) << (8 * i);

  CHECK(contains(load_error(dir, ""), "is 0 bytes, too short for the 8-byte header length"));
  CHECK(contains(load_error(dir, file.substr(0, 5)), "is 5 bytes, too short"));
  for (size_t cut : {size_t{8}, size_t{8 + n / 2}, size_t{8 + n - 1}}) {
    CAPTURE(cut);
    const std::string msg = load_error(dir, file.substr(0, cut));
    CHECK(contains(msg, "bad.safetensors"));
    CHECK(contains(msg, fmt::format("header length {} exceeds the {} bytes", n, cut - 8)));
  }
  // Cut inside the data: the last tensor (y, after x's 80 bytes) runs past the end.
  for (size_t cut : {size_t{8 + n}, size_t{8 + n + 40}, file.size() - 1}) {
    CAPTURE(cut);
    const std::string msg = load_error(dir, file.substr(0, cut));
    CHECK(contains(msg, "run past the"));
    CHECK(contains(msg, "(truncated?)"));
    CHECK(contains(msg, fmt::format("{} data bytes", cut - 8 - n)));
  }
  CHECK(contains(load_error(dir, file.substr(0, 8 + n + 80)), "tensor 'y' data_offsets [80, 92]"));
  // The intact file still loads: the cuts above are what broke it.
  CHECK(load_error(dir, file).empty());
  // Extra bytes after the data are garbage, not ignored.
  const std::string trailing = load_error(dir, file + "junk");
  CHECK(contains(trailing, "4 trailing bytes after the last tensor's data"));
}

TEST_CASE("safetensors: corrupt or invalid headers name the path, tensor and values") {
  const std::string dir = make_temp_dir();
  const std::string f32x2 = std::string(8, '\0');  // two f32 zeros

  SUBCASE("invalid JSON") {
    const std::string msg = load_error(dir, raw_file(R"({"x": {"dtype": "F32",)", f32x2));
    CHECK(contains(msg, "bad.safetensors': header is not valid JSON"));
  }
  SUBCASE("header length beyond the file") {
    std::string bytes = raw_file(R"({})", "");
    bytes[0] = 100;
    CHECK(contains(load_error(dir, bytes), "header length 100 exceeds the 8 bytes"));
  }
  SUBCASE("header is not an object") {
    CHECK(contains(load_error(dir, raw_file("[1, 2]", "")),
                   "header must be a JSON object, got array"));
  }
  SUBCASE("unknown dtype") {
    const std::string msg = load_error(
        dir,
        raw_file(R"({"x": {"dtype": "F8_E4M3", "shape": [2], "data_offsets": [0, 2]}})", "ab"));
    CHECK(contains(msg, "tensor 'x' has dtype 'F8_E4M3', which Tessera does not support"));
  }
  SUBCASE("lower-case dtype is not the format's spelling") {
    const std::string msg = load_error(
        dir, raw_file(R"({"x": {"dtype": "f32", "shape": [2], "data_offsets": [0, 8]}})", f32x2));
    CHECK(contains(msg, "dtype 'f32'"));
  }
  SUBCASE("missing field") {
    const std::string msg =
        load_error(dir, raw_file(R"({"x": {"dtype": "F32", "shape": [2]}})", f32x2));
    CHECK(contains(msg, "tensor 'x' is missing field 'data_offsets'"));
  }
  SUBCASE("unknown field") {
    const std::string msg = load_error(
        dir, raw_file(R"({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8], "q": 1}})",
                      f32x2));
    CHECK(contains(msg, "tensor 'x' has unknown field 'q'"));
  }
  SUBCASE("negative or fractional dims") {
    CHECK(contains(
        load_error(
            dir,
            raw_file(R"({"x": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}})", f32x2)),
        "tensor 'x' shape [-2] must hold non-negative integers"));
    CHECK(contains(
        load_error(
            dir,
            raw_file(R"({"x": {"dtype": "F32", "shape": [2.0], "data_offsets": [0, 8]}})", f32x2)),
        "must hold non-negative integers"));
  }
  SUBCASE("shape and byte range disagree") {
    const std::string msg = load_error(
        dir,
        raw_file(R"({"x": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 8]}})", f32x2));
    CHECK(contains(msg,
                   "tensor 'x' (dtype F32, shape [2, 3]) needs 24 bytes but data_offsets "
                   "[0, 8] span 8"));
  }
  SUBCASE("offsets that end before they begin") {
    const std::string msg = load_error(
        dir, raw_file(R"({"x": {"dtype": "F32", "shape": [0], "data_offsets": [8, 0]}})", f32x2));
    CHECK(contains(msg, "data_offsets [8, 0] end before they begin"));
  }
  SUBCASE("overlapping tensors") {
    const std::string msg =
        load_error(dir, raw_file(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                          "b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}})",
                                 f32x2));
    CHECK(contains(msg, "tensor 'b' data_offsets [4, 8] overlap tensor 'a' ending at 8"));
  }
  SUBCASE("gap between tensors") {
    const std::string msg = load_error(
        dir, raw_file(R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}})", f32x2));
    CHECK(contains(msg, "tensor 'a' data_offsets [4, 8] leave a gap after byte 0"));
  }
  SUBCASE("offsets past the end of the data") {
    const std::string msg = load_error(
        dir, raw_file(R"({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}})", f32x2));
    CHECK(contains(msg, "tensor 'a' data_offsets [0, 16] run past the 8 data bytes"));
  }
  SUBCASE("data_offsets of the wrong form") {
    const std::string msg = load_error(
        dir, raw_file(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0]}})", f32x2));
    CHECK(contains(msg, "tensor 'a' data_offsets must be [begin, end]"));
  }
  SUBCASE("metadata values must be strings") {
    const std::string msg = load_error(dir, raw_file(R"({"__metadata__": {"step": 5}})", ""));
    CHECK(contains(msg, "__metadata__ value for 'step' must be a string, got 5"));
  }
  SUBCASE("bool bytes other than 0 and 1") {
    const std::string msg = load_error(
        dir, raw_file(R"({"m": {"dtype": "BOOL", "shape": [3], "data_offsets": [0, 3]}})",
                      std::string("\x01\x00\x02", 3)));
    CHECK(contains(msg, "tensor 'm' (BOOL) holds byte 2 at element 2"));
  }
  SUBCASE("a hand-written valid file loads (the cases above differ from it in one thing)") {
    const std::string path = dir + "/ok.safetensors";
    write_file(path, raw_file(R"({"b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]},
                                  "a": {"dtype": "F32", "shape": [], "data_offsets": [0, 4]}})",
                              std::string("\x00\x00\x80\x3f\x00\x00\x00\x40", 8)));
    const auto f = load_safetensors(path);
    CHECK(f.tensors.at("a").item<float>() == 1.0f);
    CHECK(f.tensors.at("b").to_vector<float>() == std::vector<float>{2.0f});
  }
  SUBCASE("missing file") {
    try {
      load_safetensors(dir + "/nope.safetensors");
      FAIL("expected an Error");
    } catch (const Error& e) {
      CHECK(contains(e.what(), "cannot open '" + dir + "/nope.safetensors': No such file"));
    }
  }
}

TEST_CASE("safetensors: saving is atomic and leaves no temp file") {
  const std::string dir = make_temp_dir();
  const std::string path = dir + "/ckpt.safetensors";
  save_safetensors(path, {{"w", ones({3})}});
  save_safetensors(path, {{"w", zeros({3})}});  // replaces the first
  CHECK(load_safetensors(path).tensors.at("w").to_vector<float>() == std::vector<float>{0, 0, 0});
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(dir)) names.push_back(entry.path().filename());
  CHECK(names == std::vector<std::string>{"ckpt.safetensors"});

  const std::string before = read_file(path);
  SUBCASE("the temp file cannot be created: the old file stays") {
    // A directory where the temp file would go makes open() fail even for root.
    const std::string tmp = fmt::format("{}.tmp.{}", path, ::getpid());
    REQUIRE(fs::create_directory(tmp));
    try {
      save_safetensors(path, {{"w", full({3}, 5.0)}});
      FAIL("expected an Error");
    } catch (const Error& e) {
      CHECK(contains(e.what(), "save_safetensors: cannot create '" + tmp + "'"));
      CHECK(contains(e.what(), "Is a directory"));
    }
    CHECK(read_file(path) == before);
    fs::remove(tmp);
  }
  SUBCASE("the destination's directory cannot hold a file: the error names the path") {
    // Path lookup fails the same way for every user, root included (unlike a chmod 0555
    // directory, which root writes into anyway): a parent that is a regular file gives
    // ENOTDIR, a parent that does not exist ENOENT. Neither leaves anything behind.
    const std::string under_file = path + "/inner.safetensors";  // `path` is a regular file
    const std::string missing = dir + "/no_such_dir/ckpt.safetensors";
    const std::vector<std::pair<std::string, std::string>> cases = {
        {under_file, "Not a directory"}, {missing, "No such file or directory"}};
    for (const auto& c : cases) {
      const std::string& target = c.first;
      const std::string& reason = c.second;
      CAPTURE(target);
      try {
        save_safetensors(target, {{"w", full({3}, 5.0)}});
        FAIL("expected an Error");
      } catch (const Error& e) {
        const std::string msg = e.what();
        CHECK_MESSAGE(contains(msg, "save_safetensors: cannot create '" + target + ".tmp."), msg);
        CHECK_MESSAGE(contains(msg, reason), msg);
      }
    }
    CHECK(read_file(path) == before);
    CHECK(!fs::exists(dir + "/no_such_dir"));
    std::vector<std::string> after;
    for (const auto& entry : fs::directory_iterator(dir)) after.push_back(entry.path().filename());
    CHECK(after == std::vector<std::string>{"ckpt.safetensors"});
  }
  SUBCASE("the rename fails: the temp file is removed") {
    const std::string target = dir + "/occupied";
    REQUIRE(fs::create_directory(target));
    write_file(target + "/inside", "x");  // a non-empty directory cannot be renamed over
    try {
      save_safetensors(target, {{"w", ones({2})}});
      FAIL("expected an Error");
    } catch (const Error& e) {
      CHECK(contains(e.what(), "cannot rename"));
      CHECK(contains(e.what(), "to '" + target + "'"));
    }
    CHECK(!fs::exists(fmt::format("{}.tmp.{}", target, ::getpid())));
  }
  SUBCASE("bad input is rejected before anything is written") {
    const std::string other = dir + "/other.safetensors";
    CHECK_THROWS_WITH_AS(save_safetensors(other, {{"x", Tensor()}}),
                         doctest::Contains("tensor 'x' is undefined"), Error);
    CHECK_THROWS_WITH_AS(save_safetensors(other, {{"__metadata__", ones({1})}}),
                         doctest::Contains("'__metadata__' is reserved"), Error);
    CHECK(!fs::exists(other));
    CHECK(!fs::exists(fmt::format("{}.tmp.{}", other, ::getpid())));
  }
}

TEST_CASE("safetensors: PyTorch reads Tessera's file with the expected values") {
  const char* python = "/usr/bin/python3";
  const std::string script = "tools/safetensors_check.py";  // runfiles-relative (data dep)
  REQUIRE_MESSAGE(fs::exists(script), "missing data dependency " << script);
  // /usr/bin/python3 with torch is a declared dependency (tools/setup.sh installs Debian's
  // python3-torch): missing, the test fails rather than skipping the cross-check.
  REQUIRE_MESSAGE(::access(python, X_OK) == 0,
                  python << " is missing; install Debian's python3-torch (tools/setup.sh does)");
  REQUIRE_MESSAGE(std::system("/usr/bin/python3 -c 'import torch' >/dev/null 2>&1") == 0,
                  python << " cannot import torch; install Debian's python3-torch "
                            "(tools/setup.sh does)");
  const std::string dir = make_temp_dir();
  const std::string path = dir + "/cross.safetensors";
  std::map<std::string, Tensor> tensors;
  tensors["f32_t"] = (arange(0, 6, 1, DType::f32) * 0.1).reshape({2, 3}).t();  // non-contiguous
  tensors["f32_strided"] = arange(0, 10, 1, DType::f32).slice(0, 1, 10, 3);    // a view
  tensors["f64_scalar"] = Tensor::from_vector<double>({std::acos(-1.0)}, {});
  tensors["f16"] =
      Tensor::from_vector<float>({0.1f, -2.5f, 65504.0f, 6e-8f}, {2, 2}).cast(DType::f16);
  tensors["bf16"] = Tensor::from_vector<float>({3.14159f, -1e30f, 1.0f / 3}, {3}).cast(DType::bf16);
  tensors["i32"] = Tensor::from_vector<int32_t>({-2147483647 - 1, 0, 42}, {3});
  tensors["i64"] = Tensor::from_vector<int64_t>({(int64_t{1} << 60) + 1, -3}, {2, 1});
  tensors["bool"] = Tensor::from_vector<bool>({true, false, true}, {3});
  tensors["empty"] = Tensor::empty({0, 5}, DType::f32);
  const std::map<std::string, std::string> meta = {{"format", "pt"}, {"epoch", "3"}};
  REQUIRE(!tensors["f32_t"].is_contiguous());
  save_safetensors(path, tensors, meta);

  json expect = {{"metadata", meta}, {"tensors", json::object()}};
  for (const auto& [name, t] : tensors) {
    json values = json::array();
    if (is_floating(t.dtype())) {
      for (double v : t.to_vector<double>()) values.push_back(v);  // exact for f16/bf16 too
    } else {
      for (int64_t v : t.to_vector<int64_t>()) values.push_back(v);
    }
    expect["tensors"][name] = {
        {"dtype", nn::safetensors_dtype_name(t.dtype())}, {"shape", t.shape()}, {"values", values}};
  }
  write_file(dir + "/expect.json", expect.dump());
  const std::string cmd =
      fmt::format("{} {} {} --expect {}/expect.json 2>&1", python, script, path, dir);
  const int status = std::system(cmd.c_str());
  REQUIRE(WIFEXITED(status));
  CHECK_MESSAGE(WEXITSTATUS(status) == 0, "command failed: " << cmd);

  // The checker also rejects what Tessera rejects, so its "OK" above means something.
  write_file(dir + "/broken.safetensors", read_file(path) + "x");
  const int broken = std::system(
      fmt::format("{} {} {}/broken.safetensors >/dev/null 2>&1", python, script, dir).c_str());
  CHECK(WEXITSTATUS(broken) == 2);
}
