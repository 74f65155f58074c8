// One structured log line per event: UTC timestamp, level, component and request id, then the
// message. `MOBIUS_LOG(INFO, "router", request_id) << "...";` writes to stderr atomically.
#ifndef MOBIUS_COMMON_LOGGING_H_
#define MOBIUS_COMMON_LOGGING_H_

#include <sstream>
#include <string>
#include <string_view>

namespace mobius {

enum class LogLevel { kDEBUG, kINFO, kWARNING, kERROR };

class LogLine {
 public:
  LogLine(LogLevel level, std::string_view component, std::string_view request_id);
  ~LogLine();
  LogLine(const LogLine&) = delete;
  LogLine& operator=(const LogLine&) = delete;

  template <typename T>
  LogLine& operator<<(const T& value) {
    stream_ << value;
    return *this;
  }

 private:
  std::ostringstream stream_;
};

// Lines below this level are dropped (MOBIUS_LOG_LEVEL=debug|info|warning|error, default info).
bool LogEnabled(LogLevel level);

}  // namespace mobius

#define MOBIUS_LOG(level, component, request_id)             \
  if (!::mobius::LogEnabled(::mobius::LogLevel::k##level)) { \
  } else                                                     \
    ::mobius::LogLine(::mobius::LogLevel::k##level, component, request_id)

#endif  // MOBIUS_COMMON_LOGGING_H_
