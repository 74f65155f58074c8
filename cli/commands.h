// Subcommands of the `mobius` command-line tool. Each command's flags are defined in its own
// source file (`<name>_command.cc`), which is how `mobius <name> --help` finds them; main.cc
// parses the command line and then calls the command's entry point.
#ifndef MOBIUS_CLI_COMMANDS_H_
#define MOBIUS_CLI_COMMANDS_H_

#include <string>
#include <vector>

namespace mobius::cli {

// Each returns the process exit code: 0 on success, 1 on a runtime error, 2 on bad usage.
int RunGenerateCommand();
int RunInspectCommand();
int RunTokenizeCommand();
int RunBenchCommand(const std::vector<std::string>& args);  // args: {"engine"}
int RunBenchServeCommand();  // `mobius bench serve` (main.cc routes it; own flags)

}  // namespace mobius::cli

#endif  // MOBIUS_CLI_COMMANDS_H_
