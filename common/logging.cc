#include "common/logging.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace mobius {
namespace {

const char* LevelName(LogLevel level) {
  switch (level) {
    case LogLevel::kDEBUG:
      return "DEBUG";
    case LogLevel::kINFO:
      return "INFO";
    case LogLevel::kWARNING:
      return "WARNING";
    case LogLevel::kERROR:
      return "ERROR";
  }
  return "?";
}

LogLevel MinLevel() {
  static const LogLevel level = [] {
    const char* env = std::getenv("MOBIUS_LOG_LEVEL");
    if (env == nullptr) return LogLevel::kINFO;
    if (std::strcmp(env, "debug") == 0) return LogLevel::kDEBUG;
    if (std::strcmp(env, "warning") == 0) return LogLevel::kWARNING;
    if (std::strcmp(env, "error") == 0) return LogLevel::kERROR;
    return LogLevel::kINFO;
  }();
  return level;
}

}  // namespace

bool LogEnabled(LogLevel level) { return level >= MinLevel(); }

LogLine::LogLine(LogLevel level, std::string_view component, std::string_view request_id) {
  stream_ << absl::FormatTime("%Y-%m-%dT%H:%M:%E3SZ", absl::Now(), absl::UTCTimeZone()) << ' '
          << LevelName(level) << ' ' << component << ' '
          << (request_id.empty() ? std::string_view("-") : request_id) << ' ';
}

LogLine::~LogLine() {
  stream_ << '\n';
  const std::string line = stream_.str();
  std::fwrite(line.data(), 1, line.size(), stderr);  // one write: lines never interleave
}

}  // namespace mobius
