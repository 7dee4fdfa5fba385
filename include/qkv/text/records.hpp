// Datasets of texts for fine-tuning, read from the files people have:
//   labelled texts  CSV with a header (the book's SMS spam layout: Label,Text; RFC 4180 quoting: fields with commas,
//                   quotes ("") and newlines), TSV (tab-separated, the raw SMSSpamCollection has no header) and JSON
//                   Lines ({"text": …, "label": …} per line); labels integers or strings;
//   instructions    the book's instruction-data.json: a JSON list of {"instruction", "input", "output"} (Alpaca).
// Every problem is a ValueError naming the file, the line and, for a table, the column.
// Not here: tokenising, batching or training (train/finetune.hpp).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace qkv::text {

// One row of a classification file: its text and label
struct LabelledText {
  std::string text, label;  // the text and its label, as written
  int64_t line = 0;  // where the record starts in its file (1-based)
};

// Which columns (or JSON keys) hold the texts and the labels
struct TableColumns {
  std::string text = "Text", label = "Label";  // header names (CSV, TSV with a header) or JSON keys (case-sensitive)
};

// The format from the extension: .csv is CSV, .jsonl/.ndjson JSON Lines, anything else tab-separated. A TSV whose first
// line does not name both columns has none: its first field is the label, the second the text (SMSSpamCollection).
std::vector<LabelledText> read_labelled_texts(const std::string& path, const TableColumns& columns = {});

// Parses CSV/TSV text into rows of fields (RFC 4180: "…" quotes a field, "" inside it is a quote; CRLF or LF ends a
// row outside quotes). `lines` receives each row's first line. ValueError naming `label` for an unterminated quote or
// a stray quote inside an unquoted field.
std::vector<std::vector<std::string>> parse_delimited(const std::string& text, char delimiter, const std::string& label,
                                                      std::vector<int64_t>* lines = nullptr);

// One Alpaca entry
struct Instruction {
  std::string instruction, input, output;  // the task, its optional input, and the expected response
};
// The book's instruction-data.json (a JSON list of objects with "instruction", "output" and an optional "input").
std::vector<Instruction> read_instructions(const std::string& path);
// The same from JSON text; `label` names it in messages.
std::vector<Instruction> parse_instructions(const std::string& json, const std::string& label);

// The book's format_input (chapter 7): the Alpaca prompt without the response:
//   "Below is an instruction that describes a task. Write a response that appropriately completes the request."
//   "\n\n### Instruction:\n" + instruction, then "\n\n### Input:\n" + input when input is not empty.
std::string alpaca_prompt(const Instruction& entry);
// What follows the prompt in training: "\n\n### Response:\n" + output.
std::string alpaca_response(const Instruction& entry);

// A whole text file into memory, refusing what is not a regular file (a device such as /dev/zero, a FIFO) or is larger
// than `limit` bytes, with a message naming the path and the limit. IoError.
std::string read_text_file(const std::string& path, int64_t limit = int64_t{1} << 31);

}  // namespace qkv::text
