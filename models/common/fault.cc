#include "models/common/fault.h"

#include <signal.h>

#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "tensor/error.h"

namespace tessera::models {
namespace {

struct Fault {
  bool enabled = false;
  std::string point, action;
  long hit = 1;
  long rank = -1;  // -1: any
  std::string error;  // a malformed spec, reported at the first fault_point()
};

Fault parse(const char* env) {
  Fault f;
  if (env == nullptr || *env == '\0') return f;
  std::vector<std::string> parts;
  std::string text = env, part;
  for (char c : text + ":") {
    if (c == ':') {
      parts.push_back(part);
      part.clear();
    } else {
      part += c;
    }
  }
  auto number = [&](const std::string& s, long* out) {
    char* end = nullptr;
    *out = std::strtol(s.c_str(), &end, 10);
    return !s.empty() && *end == '\0';
  };
  const bool ok = parts.size() >= 2 && parts.size() <= 4 && !parts[0].empty() &&
                  (parts[1] == "kill" || parts[1] == "stop" || parts[1] == "term" ||
                   parts[1] == "int" || parts[1] == "throw") &&
                  (parts.size() < 3 || (number(parts[2], &f.hit) && f.hit >= 1)) &&
                  (parts.size() < 4 || number(parts[3], &f.rank));
  if (!ok) {
    f.error = fmt::format(
        "TESSERA_FAULT='{}' is not <point>:<kill|stop|term|int|throw>[:<hit >= 1>[:<rank>]]",
        text);
  } else {
    f.point = parts[0];
    f.action = parts[1];
  }
  f.enabled = true;
  return f;
}

const Fault& fault() {
  static const Fault f = parse(std::getenv("TESSERA_FAULT"));
  return f;
}

}  // namespace

void fault_point(std::string_view point, int rank) {
  const Fault& f = fault();
  if (!f.enabled) [[likely]] return;
  if (!f.error.empty()) throw Error(f.error);
  if (point != f.point || (f.rank >= 0 && rank != f.rank)) return;
  static std::mutex mu;
  static std::map<int, long> hits;  // per rank: threads-backend ranks share the process
  {
    std::lock_guard<std::mutex> lock(mu);
    if (++hits[rank] != f.hit) return;
  }
  std::fprintf(stderr, "fault injection: %s at %.*s (hit %ld, rank %d)\n", f.action.c_str(),
               static_cast<int>(point.size()), point.data(), f.hit, rank);
  std::fflush(stderr);
  if (f.action == "throw") {
    fail("fault injection: an error at {} (hit {}, rank {})", point, f.hit, rank);
  }
  const int sig = f.action == "kill"   ? SIGKILL
                  : f.action == "stop" ? SIGSTOP
                  : f.action == "term" ? SIGTERM
                                       : SIGINT;
  // raise(): delivered to this thread before it returns, so a SIGTERM's handler has run when
  // the caller goes on (kill(getpid()) may pick another thread, later). SIGKILL and SIGSTOP
  // act on the whole process either way.
  ::raise(sig);
}

}  // namespace tessera::models
