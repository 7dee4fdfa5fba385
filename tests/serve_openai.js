// Drives `qkv serve` with the official openai npm client, as an application would: a chat answered whole and
// streamed must give the text `qkv generate --chat --greedy` gives, alone and TOGETHER at once (default 3, half of
// them streamed); models, text completions with a stop string, and the client's typed errors for a wrong key and bad
// fields. With `only`, just the requests at once (a server started with --parallel TOGETHER: all run together).
//   node serve_openai.js NODE_MODULES BASE_URL API_KEY EXPECTED_TEXT_FILE MAX_TOKENS [TOGETHER [only]]
const { createRequire } = require("module");
const fs = require("fs");
const [modules, baseURL, apiKey, expectedFile, maxTokensText, togetherText, only] = process.argv.slice(2);
const togetherCount = Number(togetherText || 3);
const OpenAI = createRequire(modules + "/")("openai").default;
const expected = fs.readFileSync(expectedFile, "utf8");
const maxTokens = Number(maxTokensText);
const client = new OpenAI({ baseURL, apiKey, maxRetries: 0, timeout: 20000 });
const messages = [{ role: "user", content: "Hello" }];
let failures = 0;
function check(ok, what, detail) {
  if (ok) console.log("ok: " + what);
  else { failures++; console.log("FAIL: " + what + (detail === undefined ? "" : ": " + JSON.stringify(detail))); }
}
async function streamed() {
  const stream = await client.chat.completions.create({ model: "tiny", messages, temperature: 0, max_tokens: maxTokens,
                                                         stream: true, stream_options: { include_usage: true } });
  let text = "", finish = null, usage = null, role = null;
  for await (const chunk of stream) {
    if (chunk.usage) usage = chunk.usage;
    for (const c of chunk.choices) {
      if (c.delta.role) role = c.delta.role;
      if (c.delta.content) text += c.delta.content;
      if (c.finish_reason) finish = c.finish_reason;
    }
  }
  return { text, finish, usage, role };
}
async function together() {
  const requests = [];
  for (let i = 0; i < togetherCount; ++i)
    requests.push(i % 2 === 0 ? streamed() : client.chat.completions.create({ model: "tiny", messages, temperature: 0, max_tokens: maxTokens }));
  const texts = (await Promise.all(requests)).map((r) => r.text ?? r.choices[0].message.content);
  check(texts.every((t) => t === expected), `${togetherCount} requests at once (${Math.ceil(togetherCount / 2)} streamed) each give qkv generate's text`, texts);
}
(async () => {
  if (only === "only") {
    await together();
    process.exit(failures ? 1 : 0);
  }
  const models = await client.models.list();
  check(models.data.length === 1 && models.data[0].id === "tiny" && models.data[0].object === "model", "/v1/models lists the model", models.data);
  const whole = await client.chat.completions.create({ model: "tiny", messages, temperature: 0, max_tokens: maxTokens });
  check(whole.choices[0].message.content === expected, "chat completion = qkv generate --chat",
        [whole.choices[0].message.content, expected]);
  check(whole.choices[0].finish_reason === "length" && whole.usage.completion_tokens === maxTokens &&
        whole.usage.total_tokens === whole.usage.prompt_tokens + maxTokens, "finish_reason and usage", [whole.choices[0].finish_reason, whole.usage]);
  const s = await streamed();
  check(s.text === expected && s.role === "assistant" && s.finish === "length", "streamed chat = qkv generate --chat", s);
  check(s.usage && s.usage.completion_tokens === maxTokens && s.usage.prompt_tokens === whole.usage.prompt_tokens, "stream_options.include_usage", s.usage);
  await together();
  // A stop string: the reply ends before it, finish_reason "stop".
  const cut = expected.slice(0, Math.max(1, Math.floor(expected.length / 2)));
  const stopAt = [...expected.slice(cut.length)].slice(0, 2).join("");
  const stopped = await client.chat.completions.create({ model: "tiny", messages, temperature: 0, max_tokens: maxTokens, stop: [stopAt] });
  const want = expected.slice(0, expected.indexOf(stopAt));
  check(stopped.choices[0].message.content === want && stopped.choices[0].finish_reason === "stop", "a stop string ends the reply before it",
        [stopped.choices[0].message.content, want, stopped.choices[0].finish_reason]);
  const text = await client.completions.create({ model: "tiny", prompt: "The quick brown fox", max_tokens: 3, temperature: 0 });
  check(typeof text.choices[0].text === "string" && text.usage.completion_tokens === 3 && text.object === "text_completion", "/v1/completions", text);
  // Sampling with a seed is repeatable.
  const a = await client.chat.completions.create({ model: "tiny", messages, temperature: 1.0, top_p: 0.9, seed: 7, max_tokens: 6, presence_penalty: 0.5, frequency_penalty: 0.5 });
  const b = await client.chat.completions.create({ model: "tiny", messages, temperature: 1.0, top_p: 0.9, seed: 7, max_tokens: 6, presence_penalty: 0.5, frequency_penalty: 0.5 });
  check(a.choices[0].message.content === b.choices[0].message.content, "the same seed gives the same sample", [a.choices[0].message.content, b.choices[0].message.content]);
  // Typed errors
  const expectError = async (what, status, f) => {
    try { await f(); check(false, what + " → " + status, "no error"); }
    catch (e) { check(e.status === status && e.error && typeof e.error.message === "string", what + " → " + status, [e.status, e.error]); }
  };
  const wrong = new OpenAI({ baseURL, apiKey: "wrong-key", maxRetries: 0 });
  await expectError("a wrong API key", 401, () => wrong.chat.completions.create({ model: "tiny", messages }));
  await expectError("temperature 5", 400, () => client.chat.completions.create({ model: "tiny", messages, temperature: 5 }));
  await expectError("max_tokens past the context", 400, () => client.chat.completions.create({ model: "tiny", messages, max_tokens: 1e9 }));
  await expectError("an unknown role", 400, () => client.chat.completions.create({ model: "tiny", messages: [{ role: "wizard", content: "x" }] }));
  await expectError("no messages", 400, () => client.chat.completions.create({ model: "tiny", messages: [] }));
  console.log(failures === 0 ? "openai client: every check passed" : `openai client: ${failures} checks failed`);
  process.exit(failures === 0 ? 0 : 1);
})().catch((e) => { console.log("FAIL: " + (e.stack || e)); process.exit(1); });
