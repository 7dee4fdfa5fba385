// Settings declared once: a table of {key, flag, help, how to read and write the value} drives command-line
// options, the strings a checkpoint stores, validation and the resume diff. Numbers are parsed with checks
// (the whole text, no overflow, finite) and printed in the shortest form that reads back exactly.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

namespace qkv {

// Each throws ValueError naming `what` and the text: "lr = \"abc\" is not a number".
int64_t parse_int(std::string_view text, const std::string& what);
uint64_t parse_uint(std::string_view text, const std::string& what);
double parse_real(std::string_view text, const std::string& what);  // finite only
bool parse_bool(std::string_view text, const std::string& what);     // true/false, True/False, 1/0
// The shortest decimal that parses back to exactly v: 0.05 → "0.05", 1e-05 → "1e-05".
std::string format_real(double v);

template <typename S>
// One setting of a settings struct S: its names, help, how to print and parse it
struct Setting {
  const char* key;   // the name in checkpoints and configuration files, e.g. "learning_rate"
  const char* flag;  // the command-line flag, e.g. "--lr" (nullptr: not on the command line)
  const char* help;  // the command line's help text
  bool is_flag = false;          // a boolean given as a bare flag (--qkv-bias)
  bool must_match = true;        // a resumed run must keep it (model shape, data, seed) or may change it
  std::function<std::string(const S&)> get;  // prints the setting's value
  std::function<void(S&, std::string_view)> set;  // parses with the checks above
  // What a file written before this setting existed means by leaving it out (nullptr: a file must hold it)
  const char* absent = nullptr;
};

namespace settings {

template <typename S, typename T>
Setting<S> field(const char* key, const char* flag, const char* help, T S::*member, bool must_match = true) {
  Setting<S> s{key, flag, help, std::is_same_v<T, bool>, must_match, nullptr, nullptr};
  s.get = [member](const S& v) -> std::string {
    if constexpr (std::is_same_v<T, bool>) return v.*member ? "true" : "false";
    else if constexpr (std::is_same_v<T, double>) return format_real(v.*member);
    else if constexpr (std::is_same_v<T, std::string>) return v.*member;
    else return std::to_string(v.*member);
  };
  s.set = [member, key](S& v, std::string_view text) {
    (void)key;  // not every type's parser names it
    if constexpr (std::is_same_v<T, bool>) v.*member = parse_bool(text, key);
    else if constexpr (std::is_same_v<T, double>) v.*member = parse_real(text, key);
    else if constexpr (std::is_same_v<T, std::string>) v.*member = std::string(text);
    else if constexpr (std::is_same_v<T, uint64_t>) v.*member = parse_uint(text, key);
    else v.*member = parse_int(text, key);
  };
  return s;
}

// A setting of an inner struct (TrainSettings::model) seen from the outer one.
template <typename Outer, typename Inner>
Setting<Outer> nested(Inner Outer::*member, const Setting<Inner>& inner) {
  Setting<Outer> s{inner.key, inner.flag, inner.help, inner.is_flag, inner.must_match, nullptr, nullptr, inner.absent};
  s.get = [member, get = inner.get](const Outer& v) { return get(v.*member); };
  s.set = [member, set = inner.set](Outer& v, std::string_view text) { set(v.*member, text); };
  return s;
}

[[noreturn]] void throw_missing(const std::string& what, const char* key);

template <typename S>
std::map<std::string, std::string> to_strings(const std::vector<Setting<S>>& schema, const S& value) {
  std::map<std::string, std::string> out;
  for (const auto& s : schema) out[s.key] = s.get(value);
  return out;
}

// Every key of the schema must be present (ValueError "<what> lacks \"key\"" otherwise) unless it says what its
// absence means; extra keys are ignored. Values are parsed, not validated: the caller validates the whole once.
template <typename S>
S from_strings(const std::vector<Setting<S>>& schema, const std::map<std::string, std::string>& values, S result,
               const std::string& what) {
  for (const auto& s : schema) {
    auto it = values.find(s.key);
    if (it == values.end() && s.absent) {
      s.set(result, s.absent);
      continue;
    }
    if (it == values.end()) throw_missing(what, s.key);
    s.set(result, it->second);
  }
  return result;
}

}  // namespace settings
}  // namespace qkv
