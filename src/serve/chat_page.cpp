// The chat page served at `/`: one static HTML file, scripts and styles inline, talking only to this server
// (the Content-Security-Policy sent with it forbids any other address). A conversation streamed through
// /v1/chat/completions; the API key, if the server wants one, is typed into the page and kept in sessionStorage.
// Not here: the attention maps of each word (issue 42, item 5).
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
  let reply = "";
  try {
    const r = await fetch("/v1/chat/completions", { method: "POST", headers: headers(),
      body: JSON.stringify({ messages, stream: true }) });
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
        for (const c of chunk.choices || []) if (c.delta && c.delta.content) reply += c.delta.content;
        out.textContent = reply;
      }
    }
    messages.push({ role: "assistant", content: reply });
  } catch (e) {
    out.className = "msg error";
    out.textContent = String(e.message || e);
    messages.pop();
  }
}
document.getElementById("form").onsubmit = e => { e.preventDefault(); send(); };
// A link may carry a first message (…/#say=Hello): sent once the page loads.
if (location.hash.startsWith("#say=")) { text.value = decodeURIComponent(location.hash.slice(5)); send(); }
text.onkeydown = e => { if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); send(); } };
</script></body></html>
)HTML";
}

}  // namespace qkv::serve
