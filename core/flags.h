// The command-line flags of every binary: a thin layer over CLI11, which does
// the parsing (CLI11 stays out of this header; only core/flags.cc compiles it).
//
// Flags are `--name=value` or `--name value`; a value may start with '-'
// (`--metrics-port -1`). Booleans take `--name`, `--name=true|false` (also
// yes/no, 1/0) and `--no-name`. A flag given twice: the last one counts.
// Integers are decimal int64 (a leading 0 is not octal); doubles are decimal
// or exponent notation. `--name=` is an empty value (it does not take the next
// argument). Arguments that are not flags (and everything after `--`) are
// positional and returned by Parse(); `-5` and `-` are positional, any other
// `-x` is a flag (and unknown unless it is -h).
//
// `--help` / `-h` prints the usage text and every flag with its type, default
// and help (wrapped to 80 columns), then exits 0.
//
// `--config FILE` reads a JSON object of flag names (without dashes) to values
// (strings, numbers, booleans; `"no-name": true` works for booleans) through
// CLI11's config mechanism. Flags on the command line win over the file
// regardless of their order; with several --config files the later file wins.
//
// Errors print one line, "<program>: <reason>", to stderr and exit 2:
//   unknown flag --foo (see --help)         --threads needs a value
//   --threads: not an integer: 'abc'        --insecure: not a boolean: 'maybe'
//   --config: cannot read 'FILE'            --config FILE: not a JSON object
//   --config FILE: unknown flag 'foo'       --config FILE: not valid JSON: ...
// Not thread-safe; use it at the top of main().
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace moe {

// Parses "3-5,7,9" into ascending unique indexes; every index must be in
// [0, limit). InvalidArgument naming `flag` otherwise. Empty text: empty list.
absl::StatusOr<std::vector<int>> ParseIndexList(const std::string& text, int limit,
                                                const std::string& flag);

// The inverse of ParseIndexList for sorted indexes: "0-3,6" for
// {0, 1, 2, 3, 6}; "none" when empty.
std::string FormatIndexList(const std::vector<int>& sorted);

class FlagSet {
 public:
  FlagSet(std::string program, std::string usage);
  ~FlagSet();
  FlagSet(const FlagSet&) = delete;
  FlagSet& operator=(const FlagSet&) = delete;

  // Registers --name bound to *value; the value *value holds now is the default
  // --help shows. `value` must outlive Parse().
  void String(const std::string& name, std::string* value, const std::string& help);
  void Int(const std::string& name, int64_t* value, const std::string& help);
  void Double(const std::string& name, double* value, const std::string& help);
  void Bool(const std::string& name, bool* value, const std::string& help);  // also --no-name

  // Parses argv[1..]; returns the positional arguments. Exits on --help or error.
  std::vector<std::string> Parse(int argc, char** argv);

  // Prints "<program>: <message>" to stderr and exits with `code`.
  [[noreturn]] void Fail(const std::string& message, int code = 2) const;

  std::string HelpText() const;

 private:
  struct Impl;  // the CLI::App and what it parses into

  std::string program_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace moe
