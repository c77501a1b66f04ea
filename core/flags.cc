#include "core/flags.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
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

FlagSet::FlagSet(std::string program, std::string usage)
    : program_(std::move(program)), usage_(std::move(usage)) {}

void FlagSet::String(const std::string& name, std::string* value, const std::string& help) {
  flags_.push_back({name, Kind::kString, value, help, value->empty() ? "\"\"" : *value});
}
void FlagSet::Int(const std::string& name, int64_t* value, const std::string& help) {
  flags_.push_back({name, Kind::kInt, value, help, std::to_string(*value)});
}
void FlagSet::Double(const std::string& name, double* value, const std::string& help) {
  flags_.push_back({name, Kind::kDouble, value, help, absl::StrCat(*value)});
}
void FlagSet::Bool(const std::string& name, bool* value, const std::string& help) {
  flags_.push_back({name, Kind::kBool, value, help, *value ? "true" : "false"});
}

FlagSet::Flag* FlagSet::Find(const std::string& name) {
  for (Flag& f : flags_) {
    if (f.name == name) return &f;
  }
  return nullptr;
}

void FlagSet::Fail(const std::string& message, int code) const {
  std::fprintf(stderr, "%s: %s\n", program_.c_str(), message.c_str());
  std::exit(code);
}

void FlagSet::Set(Flag& flag, const std::string& text) {
  switch (flag.kind) {
    case Kind::kString:
      *static_cast<std::string*>(flag.value) = text;
      return;
    case Kind::kInt: {
      int64_t v;
      if (!absl::SimpleAtoi(text, &v)) Fail(absl::StrCat("--", flag.name, ": not an integer: '", text, "'"));
      *static_cast<int64_t*>(flag.value) = v;
      return;
    }
    case Kind::kDouble: {
      double v;
      if (!absl::SimpleAtod(text, &v)) Fail(absl::StrCat("--", flag.name, ": not a number: '", text, "'"));
      *static_cast<double*>(flag.value) = v;
      return;
    }
    case Kind::kBool: {
      bool v;
      if (!absl::SimpleAtob(text, &v)) Fail(absl::StrCat("--", flag.name, ": not a boolean: '", text, "'"));
      *static_cast<bool*>(flag.value) = v;
      return;
    }
  }
}

void FlagSet::LoadConfig(const std::string& path) {
  std::ifstream in(path);
  if (!in) Fail(absl::StrCat("--config: cannot read '", path, "'"));
  nlohmann::json j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) Fail(absl::StrCat("--config: '", path, "' is not a JSON object"));
  for (auto& [key, val] : j.items()) {
    Flag* f = Find(key);
    if (f == nullptr) Fail(absl::StrCat("--config: unknown flag '", key, "' in ", path));
    Set(*f, val.is_string() ? val.get<std::string>() : val.dump());
  }
}

std::string FlagSet::HelpText() const {
  std::ostringstream os;
  os << "Usage: " << program_ << " " << usage_ << "\n\nFlags:\n";
  for (const Flag& f : flags_) {
    os << "  --" << f.name << "  (default: " << f.default_text << ")\n      " << f.help << "\n";
  }
  os << "  --config FILE\n      JSON object of flag names to values; flags after it override it.\n";
  os << "  --help\n      Show this text.\n";
  return os.str();
}

std::vector<std::string> FlagSet::Parse(int argc, char** argv) {
  std::vector<std::string> positional;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--") {
      for (++i; i < argc; ++i) positional.push_back(argv[i]);
      break;
    }
    if (arg.rfind("--", 0) != 0 || arg.size() == 2) {
      positional.push_back(arg);
      continue;
    }
    std::string name = arg.substr(2);
    std::string value;
    bool has_value = false;
    if (size_t eq = name.find('='); eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
      has_value = true;
    }
    if (name == "help" || name == "h") {
      std::fputs(HelpText().c_str(), stdout);
      std::exit(0);
    }
    if (name == "config") {
      if (!has_value) {
        if (i + 1 >= argc) Fail("--config needs a file");
        value = argv[++i];
      }
      LoadConfig(value);
      continue;
    }
    Flag* f = Find(name);
    if (f == nullptr && name.rfind("no-", 0) == 0) {
      Flag* b = Find(name.substr(3));
      if (b != nullptr && b->kind == Kind::kBool && !has_value) {
        *static_cast<bool*>(b->value) = false;
        continue;
      }
    }
    if (f == nullptr) Fail(absl::StrCat("unknown flag --", name, " (see --help)"));
    if (!has_value) {
      if (f->kind == Kind::kBool) {
        *static_cast<bool*>(f->value) = true;
        continue;
      }
      if (i + 1 >= argc) Fail(absl::StrCat("--", name, " needs a value"));
      value = argv[++i];
    }
    Set(*f, value);
  }
  return positional;
}

}  // namespace moe
