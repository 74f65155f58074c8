// Runs a shell command to completion and captures what it prints: for tests that check a
// binary's output or exit code (`mobius ... --help`, promtool).
#ifndef MOBIUS_TESTS_UTIL_RUN_COMMAND_H_
#define MOBIUS_TESTS_UTIL_RUN_COMMAND_H_

#include <sys/wait.h>

#include <cstdio>
#include <string>

namespace mobius::testing {

struct CommandResult {
  int exit_code = -1;  // 128 + signal when killed by one; -1 when it could not start
  std::string out;     // stdout (append " 2>&1" to the command for stderr too)
};

inline CommandResult RunCommand(const std::string& command) {
  CommandResult r;
  FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) return r;
  char buffer[4096];
  while (size_t n = fread(buffer, 1, sizeof(buffer), pipe)) r.out.append(buffer, n);
  const int status = pclose(pipe);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return r;
}

}  // namespace mobius::testing

#endif  // MOBIUS_TESTS_UTIL_RUN_COMMAND_H_
