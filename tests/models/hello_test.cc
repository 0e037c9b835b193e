// The README's first example really learns, and deterministically.
#include <doctest/doctest.h>

#include <numeric>

#include "models/hello.h"

using tessera::models::HelloConfig;
using tessera::models::train_hello;

TEST_CASE("hello: the blob classifier learns") {
  const auto r = train_hello(HelloConfig{.steps = 200});
  REQUIRE(r.losses.size() == 200);
  const double first = r.losses.front();
  const double last = std::accumulate(r.losses.end() - 20, r.losses.end(), 0.0) / 20;
  CHECK(first > 0.5);          // starts near chance (ln 3 = 1.1 for a balanced guess)
  CHECK(last < 0.25 * first);  // and ends far below it
  // Blobs 3.9 apart with sd 1.2: the Bayes error is a few percent.
  CHECK(r.accuracy > 0.9);
}

TEST_CASE("hello: the same seed gives bitwise the same run") {
  const auto a = train_hello(HelloConfig{.steps = 30, .seed = 5});
  const auto b = train_hello(HelloConfig{.steps = 30, .seed = 5});
  CHECK(a.losses == b.losses);
  const auto c = train_hello(HelloConfig{.steps = 30, .seed = 6});
  CHECK(a.losses != c.losses);
}
