// A small command-line flag parser shared by every binary.
//
// Flags are `--name=value` or `--name value`; booleans also accept `--name` and
// `--no-name`. `--help` prints the usage text and every flag with its help and
// default, then exits 0. `--config FILE` reads a JSON object of flag names to
// values (command-line flags given after it win). A bad flag prints one line to
// stderr and exits 2. Not thread-safe; use it at the top of main().
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace moe {

// Parses "3-5,7,9" into ascending unique indexes; every index must be in
// [0, limit). InvalidArgument naming `flag` otherwise. Empty text: empty list.
absl::StatusOr<std::vector<int>> ParseIndexList(const std::string& text, int limit,
                                                const std::string& flag);

class FlagSet {
 public:
  FlagSet(std::string program, std::string usage);

  void String(const std::string& name, std::string* value, const std::string& help);
  void Int(const std::string& name, int64_t* value, const std::string& help);
  void Double(const std::string& name, double* value, const std::string& help);
  void Bool(const std::string& name, bool* value, const std::string& help);

  // Parses argv[1..]; returns the positional arguments. Exits on --help or error.
  std::vector<std::string> Parse(int argc, char** argv);

  // Prints "<program>: <message>" to stderr and exits with `code`.
  [[noreturn]] void Fail(const std::string& message, int code = 2) const;

  std::string HelpText() const;

 private:
  enum class Kind { kString, kInt, kDouble, kBool };
  struct Flag {
    std::string name;
    Kind kind;
    void* value;
    std::string help;
    std::string default_text;
  };
  Flag* Find(const std::string& name);
  void Set(Flag& flag, const std::string& text);
  void LoadConfig(const std::string& path);

  std::string program_;
  std::string usage_;
  std::vector<Flag> flags_;
};

}  // namespace moe
