// Uses the installed engine library the way an engine would, through the
// public header only: a session over a model with no expert server reachable
// must fail cleanly, a bad device name must be InvalidArgument. Prints "ok"
// when both hold.
#include <cstdio>

#include "moe/engine.h"

int main() {
  moe::SessionOptions o;
  o.model = "synthetic:tiny";
  if (moe::ParseDeviceChoice("no-such-device").ok()) return 1;  // names are checked where they are parsed
  o.device = *moe::ParseDeviceChoice("cpu");
  o.servers = {"unix:///nonexistent/socket"};
  absl::StatusOr<std::unique_ptr<moe::MoeSession>> s = moe::MoeSession::Open(o);
  if (s.ok()) return 2;
  std::printf("ok: %s\n", std::string(s.status().message()).c_str());
  return 0;
}
