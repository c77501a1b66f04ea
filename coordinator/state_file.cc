#include "coordinator/state_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"

namespace moe {

namespace {

constexpr char kFormat[] = "moe-coordinator-state";
constexpr int kFormatVersion = 1;

absl::Status Errno(const std::string& what, const std::string& path) {
  return absl::UnavailableError(absl::StrCat(what, " '", path, "': ", std::strerror(errno)));
}

absl::Status WriteAll(int fd, const std::string& data, const std::string& path) {
  size_t off = 0;
  while (off < data.size()) {
    const ssize_t n = write(fd, data.data() + off, data.size() - off);
    if (n < 0) {
      if (errno == EINTR) continue;
      return Errno("write", path);
    }
    off += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status WriteFileAtomically(const std::string& path, const std::string& contents) {
  const size_t slash = path.rfind('/');
  const std::string dir = slash == std::string::npos ? "." : (slash == 0 ? "/" : path.substr(0, slash));
  const std::string tmp = absl::StrCat(path, ".tmp.", getpid());
  // Owner-only (the overrides are the operator's): a fresh file, never one a
  // crashed run or another user left at the temporary name.
  unlink(tmp.c_str());
  const int fd = open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd < 0) return Errno("cannot create", tmp);
  absl::Status st = fchmod(fd, 0600) == 0 ? absl::OkStatus() : Errno("chmod 0600", tmp);
  if (st.ok()) st = WriteAll(fd, contents, tmp);
  if (st.ok() && fsync(fd) != 0) st = Errno("fsync", tmp);
  if (close(fd) != 0 && st.ok()) st = Errno("close", tmp);
  if (st.ok() && rename(tmp.c_str(), path.c_str()) != 0) st = Errno("rename to", path);
  if (!st.ok()) {
    unlink(tmp.c_str());
    return st;
  }
  // The rename is durable only once the directory entry is.
  const int dfd = open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    fsync(dfd);
    close(dfd);
  }
  return absl::OkStatus();
}

absl::StatusOr<AdminState> LoadAdminState(const std::string& path) {
  AdminState state;
  std::ifstream in(path);
  if (!in) {
    if (access(path.c_str(), F_OK) != 0 && errno == ENOENT) return state;
    return Errno("cannot read state file", path);
  }
  std::stringstream ss;
  ss << in.rdbuf();
  nlohmann::json j = nlohmann::json::parse(ss.str(), nullptr, /*allow_exceptions=*/false);
  auto bad = [&](const std::string& what) {
    return absl::DataLossError(absl::StrCat("state file '", path, "': ", what));
  };
  if (j.is_discarded() || !j.is_object()) return bad("not a JSON object");
  if (j.value("format", "") != kFormat) return bad(absl::StrCat("\"format\" is not \"", kFormat, "\""));
  if (!j.contains("version") || !j["version"].is_number_integer() || j["version"].get<int>() != kFormatVersion)
    return bad(absl::StrCat("unsupported \"version\" (expected ", kFormatVersion, ")"));
  try {
    if (j.contains("model")) {
      state.num_layers = j["model"].at("num_layers").get<int>();
      state.num_experts = j["model"].at("num_experts").get<int>();
      if (state.num_layers < 0 || state.num_experts < 0) return bad("model: negative geometry");
    }
    const nlohmann::json pins = j.contains("pins") ? j["pins"] : nlohmann::json::array();
    const nlohmann::json policy = j.contains("policy") ? j["policy"] : nlohmann::json::object();
    const nlohmann::json drains = j.contains("drains") ? j["drains"] : nlohmann::json::array();
    if (!pins.is_array() || !policy.is_object() || !drains.is_array())
      return bad("\"pins\" and \"drains\" must be arrays, \"policy\" an object");
    for (const auto& p : pins) {
      const std::string worker = p.value("worker", "");
      const int layer = p.at("layer").get<int>();
      if (layer < 0) return bad("pins: negative layer");
      std::set<int>& experts = state.pins[{worker, layer}];
      for (const auto& e : p.at("experts")) {
        if (e.get<int>() < 0) return bad("pins: negative expert");
        experts.insert(e.get<int>());
      }
    }
    for (const auto& [key, value] : policy.items())
      state.policy[key] = value.is_string() ? value.get<std::string>() : value.dump();
    for (const auto& s : drains) state.drains.insert(s.get<std::string>());
  } catch (const nlohmann::json::exception& e) {
    return bad(e.what());
  }
  return state;
}

absl::Status SaveAdminState(const std::string& path, const AdminState& state) {
  nlohmann::json j;
  j["format"] = kFormat;
  j["version"] = kFormatVersion;
  if (state.num_layers > 0) j["model"] = {{"num_layers", state.num_layers}, {"num_experts", state.num_experts}};
  j["pins"] = nlohmann::json::array();
  for (const auto& [key, experts] : state.pins) {
    if (experts.empty()) continue;
    j["pins"].push_back({{"worker", key.first}, {"layer", key.second}, {"experts", experts}});
  }
  j["policy"] = state.policy;
  j["drains"] = state.drains;
  return WriteFileAtomically(path, j.dump(2) + "\n");
}

}  // namespace moe
