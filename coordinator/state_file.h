// AdminState: the operator's overrides that must outlive a coordinator restart
// — pins, policy parameters set at run time, drains in force — and the model
// geometry learned from the first registration (to check pins before any
// worker is back). Saved as JSON with an atomic replace (write a temporary
// file beside it, fsync, rename, fsync the directory), so a crash leaves
// either the old or the new state, never a torn one. Not thread-safe.
#pragma once

#include <map>
#include <set>
#include <string>
#include <utility>

#include "absl/status/statusor.h"

namespace moe {

struct AdminState {
  int num_layers = 0;   // 0: not known yet
  int num_experts = 0;
  // (worker id or "" for every worker, layer) -> pinned experts
  std::map<std::pair<std::string, int>, std::set<int>> pins;
  std::map<std::string, std::string> policy;  // key -> value, as CoordinatorPolicy::Set takes them
  std::set<std::string> drains;               // server ids
};

// A missing file is an empty state; an unreadable or malformed one is an
// error naming the file and what is wrong (the coordinator refuses to start
// rather than silently drop an operator's pins).
absl::StatusOr<AdminState> LoadAdminState(const std::string& path);
absl::Status SaveAdminState(const std::string& path, const AdminState& state);

// Replaces `path` with `contents` atomically (same directory temporary, fsync,
// rename); the file is mode 0600 (owner only).
absl::Status WriteFileAtomically(const std::string& path, const std::string& contents);

}  // namespace moe
