// The chat page served at `/`: one static HTML file, scripts and styles inline, talking only to this server
// (the Content-Security-Policy sent with it forbids any other address). A conversation streamed through
// /v1/chat/completions; the API key, if the server wants one, is typed into the page and kept in sessionStorage.
// Each streamed piece of an answer is a word you can click: the page asks /attention what the model attended to when
// it wrote that piece (the query one position before its first token, over everything before it) and tints the
// conversation's tokens by that weight, for all layers at once or one layer, and one head or all of them.
#include "chat_page.hpp"

namespace qkv::serve {

const char* chat_page_html() {
  return R"HTML(<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>qkv chat</title>
<style>
 body { font: 15px/1.45 system-ui, sans-serif; margin: 0; background: #f6f6f4; color: #222; }
 header { padding: .6em 1em; background: #263238; color: #eee; display: flex; gap: 1em; align-items: center; }
 header input { flex: 0 1 16em; }
 #log { max-width: 52em; margin: 0 auto; padding: 1em; }
 .msg { white-space: pre-wrap; padding: .6em .9em; margin: .5em 0; border-radius: 8px; }
 .user { background: #dfe9f3; margin-left: 15%; }
 .assistant { background: #fff; margin-right: 15%; border: 1px solid #ddd; }
 .error { background: #fde2e1; }
 form { max-width: 52em; margin: 0 auto; padding: 0 1em 1em; display: flex; gap: .5em; }
 textarea { flex: 1; font: inherit; min-height: 3em; }
 .piece { cursor: pointer; border-radius: 3px; }
 .piece:hover { background: #ffe0b2; }
 .piece.chosen { background: #e65100; color: #fff; }
 #attention { background: #fff; border: 1px solid #e0c9b0; border-radius: 8px; padding: .6em .9em; margin: .5em 15% .5em 0; }
 #attention .controls { display: flex; gap: .8em; align-items: center; flex-wrap: wrap; margin: .3em 0; font-size: 90%; }
 #attention .context { font: 13px/1.9 ui-monospace, monospace; white-space: pre-wrap; word-break: break-word; }
 .att-token { border-radius: 2px; padding: 0 1px; }
 .att-query { outline: 2px solid #e65100; }
 #attention .top { font-size: 90%; color: #555; margin-top: .4em; }
 #attention .hint { font-size: 85%; color: #777; }
</style></head>
<body>
<header><b>qkv chat</b><span id="model"></span><input id="key" type="password" placeholder="API key (if the server needs one)"></header>
<div id="log"></div>
<form id="form"><textarea id="text" placeholder="Write a message; Enter sends, Shift+Enter breaks the line"></textarea>
<button>Send</button></form>
<script>
const log = document.getElementById("log"), text = document.getElementById("text"), key = document.getElementById("key");
key.value = sessionStorage.getItem("qkv-key") || "";
key.onchange = () => sessionStorage.setItem("qkv-key", key.value);
const messages = [];
// Per answer: the prompt's token ids and the reply's, as the server streamed them (return_token_ids)
const answers = [];
function headers() {
  const h = { "Content-Type": "application/json" };
  if (key.value) h["Authorization"] = "Bearer " + key.value;
  return h;
}
function add(role, content) {
  const div = document.createElement("div");
  div.className = "msg " + role;
  div.textContent = content;
  log.appendChild(div);
  div.scrollIntoView();
  return div;
}
fetch("/v1/models", { headers: headers() }).then(r => r.json()).then(j => {
  if (j.data) document.getElementById("model").textContent = j.data[0].id;
}).catch(() => {});
async function send() {
  const content = text.value.trim();
  if (!content) return;
  text.value = "";
  messages.push({ role: "user", content });
  add("user", content);
  const out = add("assistant", "");
  const answer = { prompt: [], reply: [], div: out };
  out.dataset.answer = answers.length;
  answers.push(answer);
  let reply = "";
  try {
    const r = await fetch("/v1/chat/completions", { method: "POST", headers: headers(),
      body: JSON.stringify({ messages, stream: true, return_token_ids: true }) });
    if (!r.ok) { const j = await r.json(); throw new Error(j.error ? j.error.message : r.statusText); }
    const reader = r.body.getReader(), decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const line = buffer.slice(0, end).replace(/^data: /, "");
        buffer = buffer.slice(end + 2);
        if (line === "[DONE]") continue;
        const chunk = JSON.parse(line);
        if (chunk.error) throw new Error(chunk.error.message);
        if (chunk.prompt_token_ids) answer.prompt = chunk.prompt_token_ids;
        for (const c of chunk.choices || []) {
          const ids = c.token_ids || [];
          const piece = c.delta && c.delta.content ? c.delta.content : "";
          if (piece) {  // one clickable word: it was written when its first token was
            const span = document.createElement("span");
            span.className = "piece";
            span.textContent = piece;
            span.dataset.first = answer.reply.length;
            span.title = "Click: what the model attended to when it wrote this";
            out.appendChild(span);
            reply += piece;
          }
          answer.reply.push(...ids);
        }
      }
    }
    messages.push({ role: "assistant", content: reply });
  } catch (e) {
    out.className = "msg error";
    out.textContent = String(e.message || e);
    messages.pop();
  }
}

// The attention panel: under the answer whose word was clicked
let panel = null;
function visible(token) {  // whitespace and control characters shown, so every token has a width
  return token.replace(/\n/g, "⏎\n").replace(/\t/g, "⇥").replace(/ /g, "·") || "∅";
}
async function inspect(span) {
  const answer = answers[Number(span.parentElement.dataset.answer)];
  const first = Number(span.dataset.first);
  const tokens = answer.prompt.concat(answer.reply.slice(0, first));
  if (!answer.prompt.length || !tokens.length) return;
  document.querySelectorAll(".piece.chosen").forEach(x => x.classList.remove("chosen"));
  span.classList.add("chosen");
  if (!panel) { panel = document.createElement("div"); panel.id = "attention"; }
  answer.div.after(panel);
  panel.dataset.position = tokens.length - 1;
  panel.innerHTML = "";
  const title = document.createElement("div");
  title.innerHTML = "<b></b>";
  title.firstChild.textContent = "What the model attended to when it wrote “" + span.textContent.trim() + "”";
  panel.appendChild(title);
  const controls = document.createElement("div");
  controls.className = "controls";
  const layerPick = document.createElement("select"), headPick = document.createElement("select");
  layerPick.id = "att-layer";
  headPick.id = "att-head";
  controls.append("Layer", layerPick, "Head", headPick);
  panel.appendChild(controls);
  const context = document.createElement("div");
  context.className = "context";
  panel.appendChild(context);
  const top = document.createElement("div");
  top.className = "top";
  panel.appendChild(top);
  const hint = document.createElement("div");
  hint.className = "hint";
  panel.appendChild(hint);
  let perHead = null;  // the chosen layer's heads, fetched when a layer is chosen
  const ask = async layer => {
    const body = { tokens, position: tokens.length - 1 };
    if (layer) body.layer = layer;
    const r = await fetch("/attention", { method: "POST", headers: headers(), body: JSON.stringify(body) });
    const j = await r.json();
    if (!r.ok) throw new Error(j.error ? j.error.message : r.statusText);
    return j;
  };
  let base;
  try { base = await ask(0); } catch (e) { context.textContent = String(e.message || e); return; }
  const option = (select, value, label) => {
    const o = document.createElement("option");
    o.value = value;
    o.textContent = label;
    select.appendChild(o);
  };
  option(layerPick, 0, "all " + base.layers + " (mean)");
  for (let l = 1; l <= base.layers; ++l) option(layerPick, l, String(l));
  const draw = () => {
    const layer = Number(layerPick.value), head = Number(headPick.value);
    let w;
    if (!layer) {  // every layer's head mean, averaged
      w = base.mean[0].map((_, j) => base.mean.reduce((s, row) => s + row[j], 0) / base.layers);
    } else if (!head) {
      w = base.mean[layer - 1];
    } else {
      w = perHead.per_head[head - 1];
    }
    const most = Math.max(...w) || 1;
    context.innerHTML = "";
    base.tokens.forEach((t, j) => {
      const s = document.createElement("span");
      s.className = "att-token" + (j === base.position ? " att-query" : "");
      s.textContent = visible(t);
      s.dataset.weight = w[j];
      s.style.background = "rgba(230, 81, 0, " + (w[j] / most).toFixed(3) + ")";
      if (w[j] / most > 0.55) s.style.color = "#fff";
      s.title = (100 * w[j]).toFixed(2) + "%";
      context.appendChild(s);
    });
    const order = w.map((x, j) => [x, j]).sort((a, b) => b[0] - a[0]).slice(0, 5);
    top.textContent = "Most attended: " + order.map(([x, j]) => "“" + visible(base.tokens[j]).replace(/\n/g, "") + "” " + (100 * x).toFixed(1) + "%").join(", ");
    hint.textContent = (layer ? "Layer " + layer + (head ? ", head " + head : ", mean of its " + base.heads + " heads")
                              : "Mean of all " + base.layers + " layers and their " + base.heads + " heads") +
      ". The outlined token is the one the model read when it wrote the word; darker = more attention.";
  };
  layerPick.onchange = async () => {
    headPick.innerHTML = "";
    const layer = Number(layerPick.value);
    option(headPick, 0, layer ? "all " + base.heads + " (mean)" : "—");
    perHead = null;
    if (layer) {
      try { perHead = await ask(layer); } catch (e) { hint.textContent = String(e.message || e); return; }
      for (let h = 1; h <= base.heads; ++h) option(headPick, h, String(h));
    }
    draw();
  };
  headPick.onchange = draw;
  option(headPick, 0, "—");
  draw();
}
document.getElementById("log").onclick = e => { if (e.target.classList.contains("piece")) inspect(e.target); };
document.getElementById("form").onsubmit = e => { e.preventDefault(); send(); };
// A link may carry a first message (…/#say=Hello): sent once the page loads.
if (location.hash.startsWith("#say=")) { text.value = decodeURIComponent(location.hash.slice(5)); send(); }
text.onkeydown = e => { if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); send(); } };
</script></body></html>
)HTML";
}

}  // namespace qkv::serve
