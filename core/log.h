// One-line structured logging to stderr: "<UTC time> <level> <component>] <message>".
// Thread-safe: each line is written with a single write(2).
#pragma once

#include <string_view>

#include "absl/strings/str_cat.h"

namespace moe {

enum class LogLevel { kInfo, kWarning, kError };

void LogLine(LogLevel level, std::string_view component, std::string_view message);

template <typename... Args>
void LogInfo(std::string_view component, const Args&... args) {
  LogLine(LogLevel::kInfo, component, absl::StrCat(args...));
}
template <typename... Args>
void LogWarning(std::string_view component, const Args&... args) {
  LogLine(LogLevel::kWarning, component, absl::StrCat(args...));
}
template <typename... Args>
void LogError(std::string_view component, const Args&... args) {
  LogLine(LogLevel::kError, component, absl::StrCat(args...));
}

}  // namespace moe
