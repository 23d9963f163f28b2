#pragma once
// sparkctl's command table and the context every command runs with. A command parses its
// own arguments, computes a report through library functions, and prints it as a table or,
// with --json, as JSON. It returns a process exit code (see exit_code(Errc)).
#include <iosfwd>
#include <string>
#include <vector>

#include "core/config.h"
#include "core/error.h"

namespace spark::cli {

/// Options that come before the command name.
struct GlobalOptions {
  std::string config_path;  // --config, else $SPARK_CONFIG, else ./sparkctl.env
  bool json = false;        // --json
  int verbose = 0;          // -v (repeatable)
};

/// What a command runs with: options, the environment seam and the output streams.
struct Context {
  GlobalOptions opts;
  Environment env;
  std::ostream* out = nullptr;
  std::ostream* err = nullptr;
  std::string argv0;  // path of this sparkctl binary
  /// The cluster file's text that load_config read from stdin for --config - (the head's
  /// resolved file), for commands that keep it (node launch writes it for sparkd).
  mutable std::string config_text;

  /// Loads and validates the cluster file (--config -: the head's resolved file on stdin,
  /// without this environment's overrides); the one way a command loads it. Prints warnings
  /// to err, or collects them into `diags` (for JSON).
  Result<RingConfig> load_config(std::vector<Diagnostic>* diags = nullptr) const;
  /// Prints an error (table mode: "sparkctl: message"; JSON: {"error":{...}}) and returns
  /// its exit code.
  int fail(const Error& e) const;
};

using CommandFn = int (*)(Context& ctx, const std::vector<std::string>& args);

/// One entry of the command table; drives dispatch, `help` and "did you mean".
struct Command {
  const char* name;
  const char* summary;
  CommandFn run;
};

/// All commands, in the order `help` lists them.
const std::vector<Command>& commands();

/// The whole command line: global options, then a command and its arguments.
int run(int argc, const char* const* argv, std::ostream& out, std::ostream& err,
        const Environment& env);

// Commands (one file each).
int cmd_help(Context& ctx, const std::vector<std::string>& args);
int cmd_version(Context& ctx, const std::vector<std::string>& args);
int cmd_config(Context& ctx, const std::vector<std::string>& args);

}  // namespace spark::cli
