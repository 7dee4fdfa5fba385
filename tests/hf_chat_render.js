// A conversation (JSON file) through a tokenizer_config.json's chat template with Hugging Face's Jinja (npm
// @huggingface/jinja), as transformers' apply_chat_template(add_generation_prompt=True) renders it.
// Usage: node hf_chat_render.js NODE_MODULES TOKENIZER_CONFIG MESSAGES [--no-thinking]
const path = require("path");
const fs = require("fs");
const [modules, configPath, messagesPath, flag] = process.argv.slice(2);
const { Template } = require(path.resolve(modules, "@huggingface/jinja"));
const config = JSON.parse(fs.readFileSync(configPath, "utf8"));
const text = (t) => (t && typeof t === "object" ? t.content : t) || "";
const context = {
  messages: JSON.parse(fs.readFileSync(messagesPath, "utf8")),
  add_generation_prompt: true,
  bos_token: text(config.bos_token),
  eos_token: text(config.eos_token),
};
if (flag === "--no-thinking") context.enable_thinking = false;
try {
  process.stdout.write(new Template(config.chat_template).render(context));
} catch (e) {
  process.stdout.write("ERROR: " + e.message);
  process.exitCode = 3;
}
