// Fine-tuning datasets: CSV/TSV/JSON Lines of labelled texts, the book's instruction JSON, and the Alpaca prompt.
#include "qkv/text/records.hpp"

#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "qkv/core/error.hpp"

namespace qkv::text {

namespace {

[[noreturn]] void bad(const std::string& label, int64_t line, const std::string& what) {
  throw ValueError(label + ":" + std::to_string(line) + ": " + what);
}

bool ends_with(const std::string& s, const std::string& suffix) {
  if (s.size() < suffix.size()) return false;
  return std::equal(suffix.rbegin(), suffix.rend(), s.rbegin(), [](char a, char b) {
    return std::tolower(static_cast<unsigned char>(a)) == std::tolower(static_cast<unsigned char>(b));
  });
}

std::string column_list(const std::vector<std::string>& header) {
  std::string out;
  for (const auto& h : header) out += (out.empty() ? "" : ", ") + ("'" + h + "'");
  return out;
}

// A JSON value as a label: a string as it is, an integer or a boolean in its JSON spelling.
std::string label_text(const nlohmann::json& v, const std::string& label, int64_t line, const std::string& key) {
  if (v.is_string()) return v.get<std::string>();
  if (v.is_number_integer() || v.is_number_unsigned() || v.is_boolean()) return v.dump();
  bad(label, line, "\"" + key + "\" must be a string or an integer, got " + std::string(v.type_name()));
}

bool same_name(const std::string& a, const std::string& b) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin(), [](char x, char y) {
    return std::tolower(static_cast<unsigned char>(x)) == std::tolower(static_cast<unsigned char>(y));
  });
}

// The key of `j` named `want`: exactly, else ignoring case ("text" for the default "Text"); empty if none.
std::string json_key(const nlohmann::json& j, const std::string& want) {
  if (j.contains(want)) return want;
  for (const auto& [k, v] : j.items())
    if (same_name(k, want)) return k;
  return "";
}

std::vector<LabelledText> read_json_lines(const std::string& text, const std::string& path, const TableColumns& c) {
  std::vector<LabelledText> out;
  std::istringstream in(text);
  std::string line;
  int64_t number = 0;
  while (std::getline(in, line)) {
    ++number;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.find_first_not_of(" \t") == std::string::npos) continue;
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line);
    } catch (const nlohmann::json::exception& e) {
      bad(path, number, std::string("not a JSON object: ") + e.what());
    }
    if (!j.is_object()) bad(path, number, "each line must be a JSON object with \"" + c.text + "\" and \"" + c.label + "\"");
    const std::string text_key = json_key(j, c.text), label_key = json_key(j, c.label);
    for (const auto& [key, want] : {std::pair{&text_key, &c.text}, std::pair{&label_key, &c.label}})
      if (key->empty()) bad(path, number, "no \"" + *want + "\" in this record (use --text-column/--label-column to name another key)");
    if (!j[text_key].is_string()) bad(path, number, "\"" + text_key + "\" must be a string");
    out.push_back({j[text_key].get<std::string>(), label_text(j[label_key], path, number, label_key), number});
  }
  return out;
}

}  // namespace

std::vector<std::vector<std::string>> parse_delimited(const std::string& text, char delimiter, const std::string& label,
                                                      std::vector<int64_t>* lines) {
  std::vector<std::vector<std::string>> rows;
  std::vector<std::string> row;
  std::string field;
  int64_t line = 1, row_line = 1;
  bool quoted = false, was_quoted = false, any = false;
  size_t i = 0;
  if (text.compare(0, 3, "\xEF\xBB\xBF") == 0) i = 3;  // a UTF-8 byte order mark (Excel writes one)
  auto end_field = [&] {
    row.push_back(std::move(field));
    field.clear();
    was_quoted = false;
  };
  auto end_row = [&] {
    end_field();
    const bool blank = row.size() == 1 && row[0].empty();
    if (!blank) {
      rows.push_back(std::move(row));
      if (lines) lines->push_back(row_line);
    }
    row.clear();
    any = false;
  };
  for (; i < text.size(); ++i) {
    const char ch = text[i];
    if (quoted) {
      if (ch == '"') {
        if (i + 1 < text.size() && text[i + 1] == '"') {
          field += '"';
          ++i;
        } else {
          quoted = false;
        }
      } else {
        if (ch == '\n') ++line;
        field += ch;
      }
      continue;
    }
    if (!any) row_line = line;
    any = true;
    if (ch == delimiter) {
      end_field();
    } else if (ch == '\n' || ch == '\r') {
      if (ch == '\r' && i + 1 < text.size() && text[i + 1] == '\n') ++i;
      end_row();
      ++line;
    } else if (ch == '"' && field.empty() && !was_quoted) {
      quoted = was_quoted = true;
    } else if (was_quoted) {
      bad(label, line, "text after a closing quote in column " + std::to_string(row.size() + 1) +
                           " (a quote inside a quoted field is written \"\")");
    } else if (ch == '"' && delimiter == ',') {
      bad(label, line, "a quote inside an unquoted field in column " + std::to_string(row.size() + 1) +
                           " (quote the whole field and double the quote: \"say \"\"hi\"\"\")");
    } else {
      field += ch;
    }
  }
  if (quoted) bad(label, row_line, "a quoted field that never ends (a missing closing quote)");
  if (any) end_row();
  return rows;
}

std::vector<LabelledText> read_labelled_texts(const std::string& path, const TableColumns& c) {
  const std::string text = read_text_file(path);
  if (ends_with(path, ".jsonl") || ends_with(path, ".ndjson")) return read_json_lines(text, path, c);
  const bool csv = ends_with(path, ".csv");
  std::vector<int64_t> lines;
  const auto rows = parse_delimited(text, csv ? ',' : '\t', path, &lines);
  if (rows.empty()) throw ValueError(path + ": no rows");
  const std::vector<std::string>& header = rows[0];
  auto find = [&](const std::string& name) {
    const auto exact = std::find(header.begin(), header.end(), name);
    if (exact != header.end()) return exact - header.begin();
    return std::find_if(header.begin(), header.end(), [&](const std::string& h) { return same_name(h, name); }) - header.begin();
  };
  size_t text_at = static_cast<size_t>(find(c.text)), label_at = static_cast<size_t>(find(c.label));
  size_t first = 1;
  const bool named = text_at < header.size() && label_at < header.size();
  if (!named) {
    if (csv || text_at < header.size() || label_at < header.size()) {
      std::string missing = text_at < header.size() ? c.label : label_at < header.size() ? c.text : c.text + "' and '" + c.label;
      throw ValueError(path + ":" + std::to_string(lines[0]) + ": the header has no column '" + missing + "' (it has " +
                       column_list(header) + "); name the columns with --text-column and --label-column");
    }
    label_at = 0;  // a headerless TSV: label, text (the raw SMSSpamCollection)
    text_at = 1;
    first = 0;
  }
  const size_t width = std::max(text_at, label_at) + 1;
  std::vector<LabelledText> out;
  for (size_t r = first; r < rows.size(); ++r) {
    if (rows[r].size() < width) {
      bad(path, lines[r], "this row has " + std::to_string(rows[r].size()) + " column" + (rows[r].size() == 1 ? "" : "s") +
                              "; column " + std::to_string(width) + " ('" + (named ? header[width - 1] : std::string("text")) +
                              "') is missing");
    }
    if (rows[r][label_at].empty()) bad(path, lines[r], "empty label in column " + std::to_string(label_at + 1));
    out.push_back({rows[r][text_at], rows[r][label_at], lines[r]});
  }
  return out;
}

std::vector<Instruction> parse_instructions(const std::string& json, const std::string& label) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(json);
  } catch (const nlohmann::json::exception& e) {
    throw ValueError(label + ": not valid JSON: " + e.what());
  }
  if (!j.is_array()) throw ValueError(label + ": expected a JSON list of {\"instruction\", \"input\", \"output\"} entries");
  std::vector<Instruction> out;
  for (size_t i = 0; i < j.size(); ++i) {
    const auto& e = j[i];
    const std::string where = label + ": entry " + std::to_string(i);
    if (!e.is_object()) throw ValueError(where + " is not an object");
    auto field = [&](const char* key, bool required) -> std::string {
      if (!e.contains(key) || e[key].is_null()) {
        if (required) throw ValueError(where + " has no \"" + key + "\" (every entry needs \"instruction\" and \"output\")");
        return "";
      }
      if (!e[key].is_string()) throw ValueError(where + ": \"" + key + "\" must be a string");
      return e[key].get<std::string>();
    };
    out.push_back({field("instruction", true), field("input", false), field("output", true)});
  }
  return out;
}

std::vector<Instruction> read_instructions(const std::string& path) { return parse_instructions(read_text_file(path), path); }

std::string alpaca_prompt(const Instruction& entry) {
  std::string out =
      "Below is an instruction that describes a task. Write a response that appropriately completes the request."
      "\n\n### Instruction:\n" + entry.instruction;
  if (!entry.input.empty()) out += "\n\n### Input:\n" + entry.input;
  return out;
}

std::string alpaca_response(const Instruction& entry) { return "\n\n### Response:\n" + entry.output; }

std::string read_text_file(const std::string& path, int64_t limit) {
  struct stat st{};
  if (::stat(path.c_str(), &st) != 0) throw IoError(path + ": " + std::strerror(errno));
  if (!S_ISREG(st.st_mode)) throw IoError(path + ": not a regular file (a device, pipe or directory); give a file");
  if (st.st_size > limit) {
    throw IoError(path + ": " + std::to_string(st.st_size) + " bytes is more than the " + std::to_string(limit) +
                  " qkv reads as one text");
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) throw IoError(path + ": cannot open: " + std::strerror(errno));
  std::string out(static_cast<size_t>(st.st_size), '\0');
  in.read(out.data(), st.st_size);
  if (in.gcount() != st.st_size) throw IoError(path + ": read " + std::to_string(in.gcount()) + " of its " + std::to_string(st.st_size) + " bytes");
  return out;
}

}  // namespace qkv::text
