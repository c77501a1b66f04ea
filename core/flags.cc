#include "core/flags.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <optional>
#include <sstream>

#include "CLI/CLI.hpp"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "nlohmann/json.hpp"

namespace moe {

absl::StatusOr<std::vector<int>> ParseIndexList(const std::string& text, int limit,
                                                const std::string& flag) {
  std::vector<int> out;
  if (text.empty()) return out;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    int lo, hi;
    const size_t dash = item.find('-');
    bool ok = dash == std::string::npos
                  ? absl::SimpleAtoi(item, &lo) && (hi = lo, true)
                  : absl::SimpleAtoi(item.substr(0, dash), &lo) && absl::SimpleAtoi(item.substr(dash + 1), &hi);
    if (!ok || lo < 0 || hi < lo || hi >= limit)
      return absl::InvalidArgumentError(absl::StrCat("--", flag, ": bad item '", item,
                                                     "' (expected N or A-B within [0, ", limit, "))"));
    for (int i = lo; i <= hi; ++i) out.push_back(i);
  }
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

namespace {

// CLI11's config formatter for --config: a JSON object of flag names (without
// dashes) to strings, numbers or booleans (cf. CLI11's examples/json.cpp). A
// key that names no flag of `app` is refused here, with its name.
class JsonConfig : public CLI::Config {
 public:
  explicit JsonConfig(const CLI::App* app) : app_(app) {}

  // CLI::Config's writer (config_to_str): --config is only ever read here.
  std::string to_config(const CLI::App*, bool, bool, std::string) const override { return {}; }

  std::vector<CLI::ConfigItem> from_config(std::istream& input) const override {
    ++files_read_;
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(input);
    } catch (const nlohmann::json::exception& e) {
      const std::string what = e.what();  // "[json.exception.parse_error.101] parse error at ..."
      const size_t bracket = what.find("] ");
      throw CLI::ConfigError("not valid JSON: " + (bracket == std::string::npos ? what : what.substr(bracket + 2)));
    }
    if (!j.is_object()) throw CLI::ConfigError("not a JSON object");
    std::vector<CLI::ConfigItem> items;
    for (const auto& [key, value] : j.items()) {
      const CLI::Option* opt = app_->get_option_no_throw("--" + key);
      if (opt == nullptr || !opt->get_configurable()) throw CLI::ConfigError("unknown flag '" + key + "'");
      if (!value.is_string() && !value.is_number() && !value.is_boolean())
        throw CLI::ConfigError("the value of '" + key + "' is not a string, number or boolean");
      CLI::ConfigItem item;
      item.name = key;
      item.inputs = {value.is_string() ? value.get<std::string>() : value.dump()};
      items.push_back(std::move(item));
    }
    return items;
  }

  // CLI11 reads the --config files last to first and stops at the first that
  // throws: the file being read when the error came.
  std::string FileInError(const std::vector<std::string>& files) const {
    const size_t n = files.size(), k = static_cast<size_t>(files_read_);
    return k >= 1 && k <= n ? files[n - k] : absl::StrJoin(files, ", ");
  }

 private:
  const CLI::App* app_;
  mutable int files_read_ = 0;
};

// `text` reflowed into lines of at most `width` columns (a longer word stays
// whole), each indented by `indent`. Line breaks in `text` are spaces (help
// texts were written pre-wrapped for an older layout); a blank line is kept.
std::string Wrap(const std::string& text, size_t indent, size_t width) {
  std::string out;
  size_t from = 0;
  while (from <= text.size()) {
    const size_t blank = std::min(text.find("\n\n", from), text.size());
    std::istringstream words(text.substr(from, blank - from));
    std::string line;
    for (std::string word; words >> word;) {
      if (!line.empty() && indent + line.size() + 1 + word.size() > width) {
        out += std::string(indent, ' ') + line + "\n";
        line.clear();
      }
      line += (line.empty() ? "" : " ") + word;
    }
    if (!line.empty()) out += std::string(indent, ' ') + line + "\n";
    if (blank < text.size()) out += "\n";
    from = blank + 2;
  }
  return out;
}

// --help: the usage line, then per flag its names, type and default on one
// line and its help wrapped below; --config and --help last.
class HelpFormatter : public CLI::FormatterBase {
 public:
  HelpFormatter(std::string program, std::string usage) : program_(std::move(program)), usage_(std::move(usage)) {}

  std::string make_help(const CLI::App* app, std::string, CLI::AppFormatMode) const override {
    std::string out = absl::StrCat("Usage: ", program_, usage_.empty() ? "" : " ", usage_, "\n\nFlags:\n");
    const CLI::Option* config = app->get_config_ptr();
    const CLI::Option* help = app->get_help_ptr();
    for (const CLI::Option* opt : app->get_options()) {
      if (opt->nonpositional() && opt != config && opt != help) out += Entry(opt, true);
    }
    if (config != nullptr) out += Entry(config, false);
    if (help != nullptr) out += Entry(help, false);
    return out;
  }

 private:
  static std::string Entry(const CLI::Option* opt, bool show_default) {
    std::vector<std::string> names;
    for (const std::string& s : opt->get_snames()) names.push_back("-" + s);
    for (const std::string& l : opt->get_lnames()) names.push_back("--" + l);
    std::string line = "  " + absl::StrJoin(names, ", ");
    if (opt->get_items_expected_max() != 0) line += " " + opt->get_type_name();
    if (show_default) {
      const std::string& d = opt->get_default_str();
      line += "  (default: " + (d.empty() ? std::string("\"\"") : d) + ")";
    }
    return line + "\n" + Wrap(opt->get_description(), 6, 80);
  }

  std::string program_, usage_;
};

// Transforms (they may rewrite the text CLI11 then converts): the error names
// the value; CLI11 prefixes the flag ("--threads: not an integer: 'abc'").
CLI::Validator IntText() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        int64_t v;
        if (!absl::SimpleAtoi(text, &v)) return absl::StrCat("not an integer: '", text, "'");
        text = std::to_string(v);  // decimal: CLI11 alone reads "010" as octal
        return "";
      },
      "");
}
CLI::Validator DoubleText() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        double v;
        if (!absl::SimpleAtod(text, &v)) return absl::StrCat("not a number: '", text, "'");
        text = std::string(absl::StripAsciiWhitespace(text));
        return "";
      },
      "");
}
CLI::Validator BoolText() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        bool v;
        if (!absl::SimpleAtob(text, &v)) return absl::StrCat("not a boolean: '", text, "'");
        text = v ? "true" : "false";
        return "";
      },
      "");
}

}  // namespace

struct FlagSet::Impl {
  CLI::App app;
  std::shared_ptr<JsonConfig> config;
  std::vector<std::string> positional;
  std::vector<std::string> value_flags;  // --NAME of the flags that take a value

  Impl(const std::string& program, const std::string& usage) : app("", program) {
    app.formatter(std::make_shared<HelpFormatter>(program, usage));
    app.set_help_flag("-h,--help", "Show this text and exit.")->configurable(false);
    app.add_option("positional", positional)->configurable(false);
    app.set_config("--config", "",
                   "A JSON object of flag names (without dashes) to values (strings, numbers, booleans). Flags on "
                   "the command line win over it, whatever their order; of several --config files the later wins.")
        ->type_name("FILE")
        ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll)
        ->check(CLI::Validator(  // CLI11 skips an empty name silently
            [](std::string& path) { return path.empty() ? std::string("cannot read ''") : std::string(); }, ""));
    config = std::make_shared<JsonConfig>(&app);
    app.config_formatter(config);
    app.allow_config_extras(CLI::config_extras_mode::error);
    value_flags.push_back("--config");
  }

  // One line for a parse error (without the program name).
  std::string Message(const CLI::ParseError& e, const std::vector<std::string>& args) const;

  // A flag that takes a value: `check` (none for strings) rewrites or refuses
  // the text before CLI11 converts it; the last of repeated flags counts.
  template <typename T>
  void AddValueFlag(const std::string& name, T* value, const std::string& help, std::optional<CLI::Validator> check) {
    CLI::Option* o = app.add_option("--" + name, *value, help)->capture_default_str();
    if (check) o->transform(*check);
    o->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
    value_flags.push_back("--" + name);
  }
};

std::string FlagSet::Impl::Message(const CLI::ParseError& e, const std::vector<std::string>& args) const {
  if (dynamic_cast<const CLI::ExtrasError*>(&e) != nullptr) {
    const std::vector<std::string> extra = app.remaining();
    const std::string flag = extra.empty() ? "" : extra.front().substr(0, extra.front().find('='));
    return absl::StrCat("unknown flag ", flag, " (see --help)");
  }
  const std::vector<std::string> files = app.get_config_ptr()->results();
  if (dynamic_cast<const CLI::FileError*>(&e) != nullptr) {
    for (const std::string& f : files) {
      if (!std::ifstream(f) || CLI::detail::check_path(f.c_str()) != CLI::detail::path_type::file)
        return absl::StrCat("--config: cannot read '", f, "'");
    }
    return absl::StrCat("--config: ", e.what());
  }
  if (dynamic_cast<const CLI::ConfigError*>(&e) != nullptr)
    return absl::StrCat("--config ", config->FileInError(files), ": ", e.what());
  // CLI11 takes the next argument as the value even when it starts with '-',
  // so a value is missing only when the flag is the last argument.
  if (dynamic_cast<const CLI::ArgumentMismatch*>(&e) != nullptr && !args.empty() &&
      std::find(value_flags.begin(), value_flags.end(), args.back()) != value_flags.end())
    return absl::StrCat(args.back(), " needs a value");
  return e.what();
}

FlagSet::FlagSet(std::string program, std::string usage)
    : program_(std::move(program)), impl_(std::make_unique<Impl>(program_, usage)) {}

FlagSet::~FlagSet() = default;

void FlagSet::String(const std::string& name, std::string* value, const std::string& help) {
  impl_->AddValueFlag(name, value, help, std::nullopt);
}
void FlagSet::Int(const std::string& name, int64_t* value, const std::string& help) {
  impl_->AddValueFlag(name, value, help, IntText());
}
void FlagSet::Double(const std::string& name, double* value, const std::string& help) {
  impl_->AddValueFlag(name, value, help, DoubleText());
}
void FlagSet::Bool(const std::string& name, bool* value, const std::string& help) {
  impl_->app.add_flag("--" + name + ",!--no-" + name, *value, help)
      ->default_str(*value ? "true" : "false")
      ->transform(BoolText())
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
}

void FlagSet::Fail(const std::string& message, int code) const {
  std::fprintf(stderr, "%s: %s\n", program_.c_str(), message.c_str());
  std::exit(code);
}

std::string FlagSet::HelpText() const { return impl_->app.help(); }

std::vector<std::string> FlagSet::Parse(int argc, char** argv) {
  // CLI11 reads "--name=" as "--name" and takes the next argument as the
  // value; an empty value it is.
  std::vector<std::string> args;
  bool flags_end = false;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    flags_end = flags_end || arg == "--";
    const std::string name = arg.substr(0, arg.size() - 1);
    if (!flags_end && arg.size() > 3 && arg.back() == '=' && name.find('=') == std::string::npos &&
        std::find(impl_->value_flags.begin(), impl_->value_flags.end(), name) != impl_->value_flags.end()) {
      args.push_back(name);
      args.push_back("");
    } else {
      args.push_back(arg);
    }
  }
  try {
    impl_->app.parse(std::vector<std::string>(args.rbegin(), args.rend()));
  } catch (const CLI::CallForHelp&) {
    std::fputs(HelpText().c_str(), stdout);
    std::exit(0);
  } catch (const CLI::ParseError& e) {
    Fail(impl_->Message(e, args));
  }
  return impl_->positional;
}

std::string FormatIndexList(const std::vector<int>& v) {
  if (v.empty()) return "none";
  std::string out;
  size_t i = 0;
  while (i < v.size()) {
    size_t j = i;
    while (j + 1 < v.size() && v[j + 1] == v[j] + 1) ++j;
    if (!out.empty()) out += ",";
    out += j == i ? absl::StrCat(v[i]) : absl::StrCat(v[i], "-", v[j]);
    i = j + 1;
  }
  return out;
}

}  // namespace moe
