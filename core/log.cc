#include "core/log.h"

#include <sys/time.h>
#include <time.h>
#include <unistd.h>

#include <cstdio>
#include <string>

namespace moe {

void LogLine(LogLevel level, std::string_view component, std::string_view message) {
  timeval tv;
  gettimeofday(&tv, nullptr);
  tm t;
  gmtime_r(&tv.tv_sec, &t);
  char stamp[64];
  std::snprintf(stamp, sizeof(stamp), "%04d-%02d-%02dT%02d:%02d:%02d.%03dZ", t.tm_year + 1900,
                t.tm_mon + 1, t.tm_mday, t.tm_hour, t.tm_min, t.tm_sec,
                static_cast<int>(tv.tv_usec / 1000));
  const char lv = level == LogLevel::kInfo ? 'I' : level == LogLevel::kWarning ? 'W' : 'E';
  std::string line = std::string(stamp) + " " + lv + " ";
  line.append(component).append("] ").append(message).append("\n");
  ssize_t off = 0;
  while (off < static_cast<ssize_t>(line.size())) {
    ssize_t w = ::write(2, line.data() + off, line.size() - off);
    if (w <= 0) break;
    off += w;
  }
}

}  // namespace moe
