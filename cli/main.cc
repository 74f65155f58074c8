// `mobius`: the command-line tool. `mobius <command> [flags]`; `mobius <command> --help` lists
// the command's flags. Each command's flags live in `<command>_command.cc`.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "cli/commands.h"
#include "common/flag_spelling.h"

namespace {

struct Command {
  const char* name;
  const char* summary;
  int (*run)(const std::vector<std::string>& args);  // positional arguments after the command
};

template <int (*F)()>
int NoArgs(const std::vector<std::string>& args) {
  if (!args.empty()) {
    std::fprintf(stderr, "mobius: unexpected argument \"%s\" (flags take the form --name=value)\n",
                 args[0].c_str());
    return 2;
  }
  return F();
}

constexpr Command kCommands[] = {
    {"generate", "run a prompt of token ids through the model and generate tokens",
     NoArgs<mobius::cli::RunGenerateCommand>},
    {"inspect", "summarise a model: config, parameters, bytes read per decode step",
     NoArgs<mobius::cli::RunInspectCommand>},
    {"tokenize", "encode text to token ids or decode ids to text with a tokenizer.json",
     NoArgs<mobius::cli::RunTokenizeCommand>},
    {"bench",
     "benchmarks: `mobius bench engine` times decode steps and prefill against the "
     "bandwidth bound",
     mobius::cli::RunBenchCommand},
};

void PrintTopLevelUsage(FILE* out) {
  std::fprintf(out, "usage: mobius <command> [flags]\n\ncommands:\n");
  for (const Command& c : kCommands) std::fprintf(out, "  %-10s %s\n", c.name, c.summary);
  std::fprintf(out, "\n`mobius <command> --help` lists the flags of a command.\n");
}

// Flags are global in absl; a command accepts only the flags defined in its own file or in
// the shared ones, so that e.g. `mobius tokenize --max-tokens 3` is an error, not ignored.
bool FlagBelongsTo(absl::string_view filename, const std::string& command) {
  return absl::EndsWith(filename, absl::StrCat("cli/", command, "_command.cc")) ||
         absl::EndsWith(filename, "cli/model_flags.cc");
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || std::strcmp(argv[1], "--help") == 0 || std::strcmp(argv[1], "-h") == 0 ||
      std::strcmp(argv[1], "help") == 0) {
    PrintTopLevelUsage(argc < 2 ? stderr : stdout);
    return argc < 2 ? 2 : 0;
  }
  const Command* command = nullptr;
  for (const Command& c : kCommands) {
    if (std::strcmp(argv[1], c.name) == 0) command = &c;
  }
  if (command == nullptr) {
    std::fprintf(stderr, "mobius: unknown command \"%s\"\n\n", argv[1]);
    PrintTopLevelUsage(stderr);
    return 2;
  }
  const std::string name = command->name;

  absl::FlagsUsageConfig usage;
  usage.contains_help_flags = [name](absl::string_view file) { return FlagBelongsTo(file, name); };
  usage.contains_helpshort_flags = usage.contains_help_flags;
  usage.normalize_filename = [](absl::string_view f) { return std::string(f); };
  absl::SetFlagsUsageConfig(usage);
  absl::SetProgramUsageMessage(
      absl::StrCat("mobius ", name, ": ", command->summary, "\n\nusage: mobius ", name,
                   " [flags]\n\nFlags may be spelled with dashes or underscores "
                   "(--max-tokens or --max_tokens)."));

  // Flags are documented with dashes (--max-tokens, as vLLM spells them); absl names them with
  // underscores. Both spellings are accepted.
  std::vector<std::string> normalized = mobius::NormalizeFlagSpelling(argc, argv, 2);

  // Reject flags that belong to another command before absl parses them.
  for (const std::string& a : normalized) {
    absl::string_view arg = a;
    if (arg == "--") break;
    if (!absl::StartsWith(arg, "-")) continue;
    arg.remove_prefix(absl::StartsWith(arg, "--") ? 2 : 1);
    arg = arg.substr(0, arg.find('='));
    if (arg == "help" || arg == "helpfull" || arg == "helpshort" || arg == "version") continue;
    const absl::CommandLineFlag* flag = absl::FindCommandLineFlag(arg);
    if (flag == nullptr && absl::StartsWith(arg, "no"))
      flag = absl::FindCommandLineFlag(arg.substr(2));
    if (flag != nullptr && !FlagBelongsTo(flag->Filename(), name)) {
      std::fprintf(stderr,
                   "mobius %s: flag --%s is not a flag of this command (see mobius %s "
                   "--help)\n",
                   name.c_str(), std::string(arg).c_str(), name.c_str());
      return 2;
    }
  }

  // absl sees "mobius <command>" as the program and the rest as its arguments.
  std::string program = absl::StrCat(argv[0], " ", name);
  std::vector<char*> absl_args;
  absl_args.push_back(program.data());
  for (std::string& a : normalized) absl_args.push_back(a.data());
  std::vector<char*> positional =
      absl::ParseCommandLine(static_cast<int>(absl_args.size()), absl_args.data());
  return command->run(std::vector<std::string>(positional.begin() + 1, positional.end()));
}
