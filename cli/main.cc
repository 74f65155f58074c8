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
     "bandwidth bound; `mobius bench serve` loads a running server",
     mobius::cli::RunBenchCommand},
};

void PrintTopLevelUsage(FILE* out) {
  std::fprintf(out, "usage: mobius <command> [flags]\n\ncommands:\n");
  for (const Command& c : kCommands) std::fprintf(out, "  %-10s %s\n", c.name, c.summary);
  std::fprintf(out, "\n`mobius <command> --help` lists the flags of a command.\n");
}

// `mobius bench serve` loads no model, so it is a command of its own (flags in
// bench_serve_command.cc) that shares only --model (there: the served model's name) and --seed
// with the model commands; absl flags are global, so it cannot define flags of those names.
constexpr const char* kBenchServeSummary =
    "load a running server through the OpenAI streaming API (or one worker over gRPC) and "
    "report throughput, TTFT, TPOT, ITL and end-to-end latency as vLLM's `bench serve` does";
constexpr const char* kBenchServeUsageNote =
    "\n\nAlso: --model NAME, the model name sent in requests (default: the first of GET "
    "/v1/models), and --seed N, the seed of the prompts and arrival times (default 0). See "
    "docs/bench-serve.md.";

// Flags are global in absl; a command accepts only the flags defined in its own file or in
// the shared ones, so that e.g. `mobius tokenize --max-tokens 3` is an error, not ignored.
// `flag` is empty when only the file is known (the --help filter).
bool FlagBelongsTo(absl::string_view filename, absl::string_view flag, const std::string& command) {
  if (absl::EndsWith(filename, absl::StrCat("cli/", command, "_command.cc"))) return true;
  // One rank of a replica over several processes: the commands that run a model.
  if (absl::EndsWith(filename, "cli/replica_flags.cc")) {
    return command == "generate" || command == "bench";
  }
  if (!absl::EndsWith(filename, "cli/model_flags.cc")) return false;
  if (command == "bench_serve") return flag == "model" || flag == "seed";
  return true;
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
  const bool bench_serve =
      std::strcmp(argv[1], "bench") == 0 && argc > 2 && std::strcmp(argv[2], "serve") == 0;
  // `name` owns the flags (<name>_command.cc); `title` is how the user typed the command.
  const std::string name = bench_serve ? "bench_serve" : command->name;
  const std::string title = bench_serve ? "bench serve" : command->name;

  absl::FlagsUsageConfig usage;
  usage.contains_help_flags = [name](absl::string_view file) {
    return FlagBelongsTo(file, "", name);
  };
  usage.contains_helpshort_flags = usage.contains_help_flags;
  usage.normalize_filename = [](absl::string_view f) { return std::string(f); };
  absl::SetFlagsUsageConfig(usage);
  absl::SetProgramUsageMessage(
      absl::StrCat("mobius ", title, ": ", bench_serve ? kBenchServeSummary : command->summary,
                   "\n\nusage: mobius ", title,
                   " [flags]\n\nFlags may be spelled with dashes or underscores (--max-tokens or "
                   "--max_tokens).",
                   bench_serve ? kBenchServeUsageNote : ""));

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
    if (flag != nullptr && !FlagBelongsTo(flag->Filename(), flag->Name(), name)) {
      std::fprintf(stderr,
                   "mobius %s: flag --%s is not a flag of this command (see mobius %s "
                   "--help)\n",
                   title.c_str(), std::string(arg).c_str(), title.c_str());
      return 2;
    }
  }

  // absl sees "mobius <command>" as the program and the rest as its arguments.
  std::string program = absl::StrCat(argv[0], " ", title);
  std::vector<char*> absl_args;
  absl_args.push_back(program.data());
  for (std::string& a : normalized) absl_args.push_back(a.data());
  std::vector<char*> positional =
      absl::ParseCommandLine(static_cast<int>(absl_args.size()), absl_args.data());
  std::vector<std::string> args(positional.begin() + 1, positional.end());
  if (bench_serve) {
    if (args.size() != 1) {
      std::fprintf(stderr, "mobius bench serve: unexpected argument \"%s\"\n", args[1].c_str());
      return 2;
    }
    return mobius::cli::RunBenchServeCommand();
  }
  return command->run(args);
}
