// The chat page of `qkv serve` in Debian's chromium, driven by Playwright (npm's playwright-core, no browser of its
// own): without the key the page shows the server's 401; with it, a message streams an answer whose words are
// clickable, and a click shows what the model attended to when it wrote that word — the same weights /attention
// gives for those tokens, one per token of the conversation so far, summing to 1; picking a layer and a head redraws
// them from that head's row. Errors in the page's console fail the test.
//   node serve_page.js NODE_MODULES BASE_URL API_KEY SCREENSHOT.png
const path = require("path");
const [modules, base, key, screenshot] = process.argv.slice(2);
const { chromium } = require(path.join(modules, "playwright-core"));

function check(ok, what) {
  if (!ok) throw new Error(what);
}
const sum = xs => xs.reduce((a, b) => a + b, 0);

async function attention(body) {
  const r = await fetch(base + "/attention", {
    method: "POST", headers: { "Content-Type": "application/json", Authorization: "Bearer " + key }, body: JSON.stringify(body) });
  check(r.ok, "/attention answered " + r.status);
  return r.json();
}

(async () => {
  const browser = await chromium.launch({ executablePath: "/usr/bin/chromium", args: ["--no-sandbox", "--disable-gpu"] });
  try {
    const page = await browser.newPage({ viewport: { width: 1000, height: 900 } });
    const problems = [];
    page.on("pageerror", e => problems.push(e.message));
    page.on("console", m => { if (m.type() === "error" && !/401/.test(m.text())) problems.push(m.text()); });
    await page.goto(base + "/");

    // Without the key: the server's message, in the page
    await page.fill("#text", "Hello");
    await page.press("#text", "Enter");
    await page.waitForSelector(".msg.error", { timeout: 20000 });
    check((await page.textContent(".msg.error")).startsWith("No API key given"), "no 401 message in the page");
    console.log("ok: without the key the page shows the server's 401 message");

    // With it: an answer, streamed into clickable pieces
    await page.fill("#key", key);
    await page.dispatchEvent("#key", "change");
    await page.fill("#text", "Hello");
    await page.click("form button");
    await page.waitForFunction(() => messages.length === 2, null, { timeout: 60000 });
    const answer = await page.evaluate(() => ({ text: messages[1].content, prompt: answers[1].prompt, reply: answers[1].reply,
                                                pieces: [...document.querySelectorAll(".msg.assistant .piece")].map(x => x.textContent) }));
    check(answer.pieces.length >= 3, "the answer has " + answer.pieces.length + " pieces; the test needs 3");
    check(answer.pieces.join("") === answer.text, "the pieces do not make the answer's text");
    check(answer.prompt.length > 0 && answer.reply.length >= answer.pieces.length, "the stream gave no token ids");
    const detok = await (await fetch(base + "/detokenize", {
      method: "POST", headers: { "Content-Type": "application/json", Authorization: "Bearer " + key },
      body: JSON.stringify({ tokens: answer.reply }) })).json();
    check(detok.content === answer.text, "the streamed token ids spell " + JSON.stringify(detok.content) + ", not the answer");
    console.log(`ok: the answer streamed as ${answer.pieces.length} clickable pieces of ${answer.reply.length} tokens after a ${answer.prompt.length}-token prompt`);

    // A click on the third piece: the weights of the query one position before its first token
    const pick = 2;
    await page.click(`.msg.assistant .piece >> nth=${pick}`);
    await page.waitForSelector("#attention .att-token");
    const first = await page.$eval(`.msg.assistant .piece >> nth=${pick}`, x => Number(x.dataset.first));
    const tokens = answer.prompt.concat(answer.reply.slice(0, first));
    const shown = await page.$$eval("#attention .att-token", xs => xs.map(x => Number(x.dataset.weight)));
    check(shown.length === tokens.length, `the panel shows ${shown.length} tokens, the conversation had ${tokens.length} before the word`);
    check(Math.abs(sum(shown) - 1) < 1e-3, "the weights shown sum to " + sum(shown));
    const direct = await attention({ tokens });
    const mean = direct.mean[0].map((_, j) => sum(direct.mean.map(row => row[j])) / direct.layers);
    check(mean.every((w, j) => Math.abs(w - shown[j]) < 1e-6), "the page's weights differ from /attention's");
    const query = await page.$$eval("#attention .att-token", xs => xs.findIndex(x => x.classList.contains("att-query")));
    check(query === tokens.length - 1, "the outlined token is " + query + ", not the last one read");
    console.log(`ok: a click shows the attention of position ${tokens.length - 1} over ${shown.length} tokens (all layers' mean, sums to 1)`);

    // One layer, one head
    const layer = direct.layers, head = Math.min(2, direct.heads);
    await page.selectOption("#att-layer", String(layer));
    await page.waitForFunction(n => document.querySelectorAll("#att-head option").length === n + 1, direct.heads);
    await page.selectOption("#att-head", String(head));
    const one = await page.$$eval("#attention .att-token", xs => xs.map(x => Number(x.dataset.weight)));
    const row = (await attention({ tokens, layer })).per_head[head - 1];
    check(one.length === row.length && one.every((w, j) => w === row[j]), "layer " + layer + " head " + head + " differs from /attention");
    check(Math.abs(sum(one) - 1) < 1e-3, "head " + head + "'s weights sum to " + sum(one));
    check((await page.textContent("#attention .hint")).startsWith(`Layer ${layer}, head ${head}`), "the hint does not name the layer and head");
    console.log(`ok: layer ${layer}, head ${head}: the panel redraws that head's row (sums to 1)`);
    if (screenshot) await page.screenshot({ path: screenshot, fullPage: true });
    check(problems.length === 0, "errors in the page: " + problems.join("; "));
    console.log("ok: no error in the page's console");
  } finally {
    await browser.close();
  }
})().catch(e => {
  console.error("FAIL: " + e.message);
  process.exit(1);
});
