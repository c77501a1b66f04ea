#include "coordinator/state_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
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

namespace {

// The state file holds admin decisions (pins, drains, the policy): only this
// process's uid may have written it. Refused: a symbolic link (not followed),
// anything but a regular file, another uid's file, a group- or
// world-writable one.
absl::Status CheckOwnership(int fd, const std::string& path) {
  struct stat st {};
  if (fstat(fd, &st) != 0) return Errno("cannot stat state file", path);
  if (!S_ISREG(st.st_mode))
    return absl::FailedPreconditionError(absl::StrCat("state file '", path, "': not a regular file"));
  if (st.st_uid != geteuid())
    return absl::FailedPreconditionError(absl::StrCat("state file '", path, "': owned by uid ", st.st_uid,
                                                      ", not this process's uid ", geteuid(), "; refusing to load it"));
  if ((st.st_mode & (S_IWGRP | S_IWOTH)) != 0)
    return absl::FailedPreconditionError(absl::StrFormat(
        "state file '%s': mode %04o lets other users write it (chmod 600 it); refusing to load it", path,
        static_cast<unsigned>(st.st_mode & 07777)));
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<AdminState> LoadAdminState(const std::string& path) {
  AdminState state;
  // O_NONBLOCK: a FIFO planted as the state file must not hang the start in
  // open() waiting for a writer (CheckOwnership refuses it as not a regular
  // file); reads of a regular file ignore the flag.
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
  if (fd < 0) {
    if (errno == ENOENT) return state;
    if (errno == ELOOP)
      return absl::FailedPreconditionError(absl::StrCat("state file '", path, "': a symbolic link; refusing to follow it"));
    return Errno("cannot read state file", path);
  }
  std::string text;
  {
    absl::Status owned = CheckOwnership(fd, path);
    char buf[65536];
    ssize_t n = 0;
    while (owned.ok() && (n = read(fd, buf, sizeof(buf))) > 0) text.append(buf, static_cast<size_t>(n));
    close(fd);
    if (!owned.ok()) return owned;
    if (n < 0) return Errno("cannot read state file", path);
  }
  nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
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
