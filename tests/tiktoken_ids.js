// Text on stdin → the GPT-2 ids of the npm package tiktoken (get_encoding("gpt2"), special tokens allowed).
const path = process.argv[2];
const { get_encoding } = require(path);
const encoding = get_encoding("gpt2");
const text = require("fs").readFileSync(0, "utf8");
process.stdout.write(JSON.stringify(Array.from(encoding.encode(text, "all"))) + "\n");
encoding.free();
