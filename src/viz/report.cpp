// The attention report: grid and per-head pictures, the weights as safetensors and a self-contained HTML page
// (see qkv/viz/report.hpp).
#include "qkv/viz/report.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <map>

#include "qkv/core/error.hpp"
#include "qkv/core/ops.hpp"
#include "qkv/io/file.hpp"
#include "qkv/io/safetensors.hpp"
#include "qkv/viz/heatmap.hpp"

namespace qkv::viz {

namespace {

std::string two_digits(int64_t v) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "%02lld", static_cast<long long>(v));
  return buf;
}

// A JSON string literal; every byte outside printable ASCII is escaped, so the page is plain ASCII.
std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    if (c == '"' || c == '\\') out += '\\', out += static_cast<char>(c);
    else if (c == '<') out += "\\u003c";  // never "</script>" inside the script
    else if (c < 0x20 || c >= 0x7f) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", c);  // byte-wise; the page decodes UTF-8 (see decode() below)
      out += buf;
    } else out += static_cast<char>(c);
  }
  return out + "\"";
}

std::string base64(const std::vector<unsigned char>& bytes) {
  static const char* kAlphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  out.reserve((bytes.size() + 2) / 3 * 4);
  for (size_t i = 0; i < bytes.size(); i += 3) {
    const uint32_t n = static_cast<uint32_t>(bytes[i]) << 16 | (i + 1 < bytes.size() ? bytes[i + 1] << 8 : 0) |
                       (i + 2 < bytes.size() ? bytes[i + 2] : 0);
    out += kAlphabet[n >> 18 & 63];
    out += kAlphabet[n >> 12 & 63];
    out += i + 1 < bytes.size() ? kAlphabet[n >> 6 & 63] : '=';
    out += i + 2 < bytes.size() ? kAlphabet[n & 63] : '=';
  }
  return out;
}

// The K/V head (1-based) query head r.heads[i] reads, and the window of shown layer i (0: full causal).
int64_t kv_head(const AttentionReport& r, size_t i) { return (r.heads[i] - 1) / std::max<int64_t>(r.kv_group, 1) + 1; }
int64_t window_of(const AttentionReport& r, size_t i) { return i < r.windows.size() ? r.windows[i] : 0; }

std::string html_page(const AttentionReport& r) {
  const int64_t T = r.maps.size(2);
  // Weights quantised to a byte (1/255 steps), row by row, whole matrices: compact enough for T = 1024 heads.
  std::vector<unsigned char> bytes(static_cast<size_t>(r.maps.numel()));
  for (size_t i = 0; i < bytes.size(); ++i) {
    const float v = r.maps.data()[i];
    bytes[i] = static_cast<unsigned char>(std::lround(std::clamp(std::isfinite(v) ? v : 0.0f, 0.0f, 1.0f) * 255.0f));
  }
  std::string tokens = "[", layers = "[", heads = "[", kv = "[", windows = "[";
  for (size_t i = 0; i < r.heads.size(); ++i) kv += (i ? "," : "") + std::to_string(kv_head(r, i));
  for (size_t i = 0; i < r.layers.size(); ++i) windows += (i ? "," : "") + std::to_string(window_of(r, i));
  kv += "]", windows += "]";
  // The page labels tokens as the pictures do (a leading space '␣', split characters' bytes as \xNN).
  for (size_t i = 0; i < r.tokens.size(); ++i) tokens += (i ? "," : "") + json_string(token_label(r.tokens[i]));
  for (size_t i = 0; i < r.layers.size(); ++i) layers += (i ? "," : "") + std::to_string(r.layers[i]);
  for (size_t i = 0; i < r.heads.size(); ++i) heads += (i ? "," : "") + std::to_string(r.heads[i]);
  tokens += "]", layers += "]", heads += "]";
  std::string page = R"HTML(<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>qkv attention</title>
<style>
body { font-family: system-ui, sans-serif; margin: 24px; color: #222; }
#view { display: block; width: 100%; max-width: 1200px; }
h1 { font-size: 20px; margin: 0 0 4px; } .muted { color: #666; font-size: 14px; }
#controls { margin: 14px 0; } #controls label { margin-right: 12px; }
.head { display: inline-block; width: 22px; height: 22px; margin: 2px; border: 2px solid #fff; cursor: pointer;
        font-size: 11px; text-align: center; line-height: 22px; color: #fff; border-radius: 3px; }
.head.off { opacity: 0.2; }
svg text { font-size: 14px; cursor: pointer; } svg text.pinned { font-weight: bold; fill: #c00; }
#info { min-height: 20px; font-size: 14px; }
</style></head><body>
<h1>What attends to what</h1>
<div class="muted" id="title"></div>
<div id="controls"><label>Layer <select id="layer"></select></label>
<span class="muted">heads (click to show or hide):</span> <span id="heads"></span>
<button id="all">all heads</button> <button id="one">one head</button></div>
<div id="info">Hover a token on the left to see what it attends to; click it to keep it.</div>
<svg id="view" xmlns="http://www.w3.org/2000/svg"></svg>
<script>
const DATA = {title: @TITLE@, tokens: @TOKENS@, layers: @LAYERS@, heads: @HEADS@, kv: @KV@, group: @GROUP@,
              windows: @WINDOWS@, T: @T@, weights: "@WEIGHTS@"};
// Tokens were escaped byte by byte; join the bytes back into UTF-8 text.
function decode(s) { try { return decodeURIComponent(escape(s)); } catch (e) { return s; } }
const tokens = DATA.tokens.map(decode);
const raw = Uint8Array.from(atob(DATA.weights), c => c.charCodeAt(0));
const T = DATA.T, H = DATA.heads.length;
function weight(l, h, i, j) { return raw[((l * H + h) * T + i) * T + j] / 255; }
const COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
                "#bcbd22", "#17becf", "#393b79", "#637939", "#8c6d31", "#843c39", "#7b4173", "#3182bd"];
// One head to start with: every head at once is a tangle of lines. Layers, heads and tokens are numbered from 1,
// in the page and in its link (#layer=1&head=2&token=8).
const state = {layer: 0, heads: new Set([0]), token: null, pinned: null};
const params = new URLSearchParams(location.hash.slice(1));
if (params.has("layer")) state.layer = Math.max(0, DATA.layers.indexOf(+params.get("layer")));
if (params.has("head")) state.heads = new Set([Math.max(0, DATA.heads.indexOf(+params.get("head")))]);
if (params.has("token")) state.pinned = Math.min(Math.max(+params.get("token") - 1, 0), T - 1);
document.getElementById("title").textContent = decode(DATA.title) + " — " + T + " tokens, layers " +
    DATA.layers.join(", ") + "; heads " + DATA.heads.join(", ");
const layerSelect = document.getElementById("layer");
DATA.layers.forEach((l, i) => { const o = document.createElement("option"); o.value = i;
                                 o.textContent = l + (DATA.windows[i] > 0 ? " (sliding window " + DATA.windows[i] + ")" : "");
                                 layerSelect.appendChild(o); });
layerSelect.value = state.layer;
layerSelect.onchange = () => { state.layer = +layerSelect.value; draw(); };
const headBox = document.getElementById("heads");
DATA.heads.forEach((h, i) => { const b = document.createElement("span"); b.className = "head"; b.textContent = h;
  b.style.background = COLORS[i % COLORS.length]; b.dataset.head = h;
  b.onclick = () => { state.heads.has(i) ? state.heads.delete(i) : state.heads.add(i); draw(); };
  headBox.appendChild(b); });
document.getElementById("all").onclick = () => { state.heads = new Set(DATA.heads.map((_, i) => i)); draw(); };
document.getElementById("one").onclick = () => { state.heads = new Set([[...state.heads][0] || 0]); draw(); };
const svg = document.getElementById("view"), NS = "http://www.w3.org/2000/svg";
const rowH = 22;
// As wide as the window allows (labels at both ends, the lines between them), at most 1200 px.
let width = 0, label = 150;
function layout() {
  width = Math.max(480, Math.min(svg.parentNode.clientWidth || 800, 1200));
  label = Math.min(220, Math.max(60, width / 5));
  svg.setAttribute("viewBox", "0 0 " + width + " " + (T * rowH + 20));
  svg.setAttribute("height", T * rowH + 20);
}
window.onresize = () => { layout(); draw(); };
function draw() {
  svg.innerHTML = "";
  const leftX = label, rightX = width - label;
  [...headBox.children].forEach((b, i) => b.classList.toggle("off", !state.heads.has(i)));
  const focus = state.pinned !== null ? state.pinned : state.token;
  const lines = document.createElementNS(NS, "g"); lines.id = "lines"; svg.appendChild(lines);
  for (const h of state.heads) for (let i = 0; i < T; ++i) {
    if (focus !== null && i !== focus) continue;
    for (let j = 0; j < T; ++j) {
      const w = weight(state.layer, h, i, j);
      if (w < 0.01) continue;
      // Width and opacity both grow with the weight, from a visible 0.25 at 0.01: light heads stay readable.
      const line = document.createElementNS(NS, "line");
      line.setAttribute("x1", leftX + 8); line.setAttribute("y1", 14 + i * rowH);
      line.setAttribute("x2", rightX - 8); line.setAttribute("y2", 14 + j * rowH);
      line.setAttribute("stroke", COLORS[h % COLORS.length]); line.setAttribute("stroke-width", (1.5 + 4 * w).toFixed(2));
      line.setAttribute("stroke-opacity", (0.25 + 0.75 * Math.sqrt(w) * (focus !== null || state.heads.size === 1 ? 1 : 0.7)).toFixed(3));
      line.dataset.query = i + 1; line.dataset.key = j + 1; line.dataset.head = DATA.heads[h]; line.dataset.weight = w.toFixed(3);
      lines.appendChild(line);
    }
  }
  tokens.forEach((t, i) => {
    for (const side of ["query", "key"]) {
      const text = document.createElementNS(NS, "text");
      text.textContent = t;
      text.setAttribute("class", "token " + side + (side === "query" && i === state.pinned ? " pinned" : ""));
      text.setAttribute("x", side === "query" ? leftX : rightX);
      text.setAttribute("y", 18 + i * rowH);
      text.setAttribute("text-anchor", side === "query" ? "end" : "start");
      text.dataset.index = i + 1;
      if (side === "query") {
        text.onmouseenter = () => { state.token = i; draw(); };
        text.onmouseleave = () => { state.token = null; draw(); };
        text.onclick = () => { state.pinned = state.pinned === i ? null : i; draw(); };
      }
      svg.appendChild(text);
    }
  });
  const info = document.getElementById("info");
  if (focus === null) { info.textContent = "Hover a token on the left to see what it attends to; click it to keep it."; return; }
  let best = [];
  for (const h of state.heads) for (let j = 0; j < T; ++j) best.push([weight(state.layer, h, focus, j), j, h]);
  best.sort((a, b) => b[0] - a[0]);
  info.textContent = "Token " + (focus + 1) + ", \u201c" + tokens[focus] + "\u201d, in layer " + DATA.layers[state.layer] +
      " attends most to: " +
      best.slice(0, 3).map(([w, j, h]) => "\u201c" + tokens[j] + "\u201d (" + (j + 1) + ") " + w.toFixed(2) + " (head " + DATA.heads[h] +
                           (DATA.group > 1 ? ", K/V head " + DATA.kv[h] : "") + ")").join(", ");
}
layout();
draw();
</script></body></html>
)HTML";
  auto replace = [&](const std::string& key, const std::string& value) {
    const size_t at = page.find(key);
    page.replace(at, key.size(), value);
  };
  replace("@TITLE@", json_string(r.title));
  replace("@TOKENS@", tokens);
  replace("@LAYERS@", layers);
  replace("@HEADS@", heads);
  replace("@KV@", kv);
  replace("@GROUP@", std::to_string(std::max<int64_t>(r.kv_group, 1)));
  replace("@WINDOWS@", windows);
  replace("@T@", std::to_string(T));
  replace("@WEIGHTS@", base64(bytes));
  return page;
}

}  // namespace

std::vector<std::string> write_attention_report(const std::string& dir, const AttentionReport& r, bool per_head,
                                                const PictureOptions& pictures) {
  check_picture_options(pictures);
  if (r.maps.rank() != 4 || r.maps.size(0) != static_cast<int64_t>(r.layers.size()) ||
      r.maps.size(1) != static_cast<int64_t>(r.heads.size()) || r.maps.size(2) != static_cast<int64_t>(r.tokens.size()) ||
      r.maps.size(3) != r.maps.size(2)) {
    throw ShapeError("attention report: maps of shape " + r.maps.shape().str() + " do not match " +
                     std::to_string(r.layers.size()) + " layers × " + std::to_string(r.heads.size()) + " heads × " +
                     std::to_string(r.tokens.size()) + " tokens");
  }
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) throw IoError(dir + ": cannot create the output directory: " + ec.message());
  const int64_t L = r.maps.size(0), H = r.maps.size(1), T = r.maps.size(2);
  std::vector<std::string> labels;
  for (const auto& t : r.tokens) labels.push_back(token_label(t));
  std::vector<std::string> written;
  auto head_matrix = [&](int64_t l, int64_t h) {
    return Tensor::from(std::span<const float>(r.maps.data() + (l * H + h) * T * T, static_cast<size_t>(T * T)), {T, T});
  };
  std::vector<HeatmapPanel> panels;
  for (int64_t l = 0; l < L; ++l)
    for (int64_t h = 0; h < H; ++h)
      panels.push_back({"L" + std::to_string(r.layers[static_cast<size_t>(l)]) + " H" + std::to_string(r.heads[static_cast<size_t>(h)]) +
                            (r.kv_group > 1 ? " kv" + std::to_string(kv_head(r, static_cast<size_t>(h))) : "") +
                            (window_of(r, static_cast<size_t>(l)) > 0 ? " w" + std::to_string(window_of(r, static_cast<size_t>(l))) : ""),
                        head_matrix(l, h), causal_cells(window_of(r, static_cast<size_t>(l)))});
  written.push_back(picture_path(dir + "/attention-grid", pictures));
  save_heatmap_grid(written.back(), "Attention: layers (rows) \u00d7 heads (columns)", panels, static_cast<int>(H), labels, 1.0,
                    pictures);
  if (per_head) {
    // One picture per head, drawn on every thread (each thread its own Cairo surfaces and Pango context); the names
    // are fixed first so the list returned keeps its order.
    std::vector<std::string> paths;
    for (int64_t l = 0; l < L; ++l)
      for (int64_t h = 0; h < H; ++h)
        paths.push_back(picture_path(dir + "/layer" + two_digits(r.layers[static_cast<size_t>(l)]) + "-head" +
                                         two_digits(r.heads[static_cast<size_t>(h)]), pictures));
    std::exception_ptr failure;
#pragma omp parallel for schedule(dynamic)
    for (int64_t i = 0; i < L * H; ++i) {
      const int64_t l = i / H, h = i % H;
      try {
        HeatmapStyle style;
        style.title = "Layer " + std::to_string(r.layers[static_cast<size_t>(l)]) + ", head " +
                      std::to_string(r.heads[static_cast<size_t>(h)]) +
                      (r.kv_group > 1 ? " (K/V head " + std::to_string(kv_head(r, static_cast<size_t>(h))) + ")" : "") +
                      (window_of(r, static_cast<size_t>(l)) > 0
                           ? ", sliding window " + std::to_string(window_of(r, static_cast<size_t>(l))) : "");
        style.row_labels = style.col_labels = labels;
        style.vmax = 1.0;
        style.masked = causal_cells(window_of(r, static_cast<size_t>(l)));  // decoders are causal
        save_heatmap(paths[static_cast<size_t>(i)], head_matrix(l, h), style, pictures);
      } catch (...) {
#pragma omp critical(qkv_attention_report)
        if (!failure) failure = std::current_exception();
      }
    }
    if (failure) std::rethrow_exception(failure);
    written.insert(written.end(), paths.begin(), paths.end());
  }
  if (r.sink_share.defined()) {  // rows: layer and head; columns: the tokens; cells: the weight each row gave the sink
    std::vector<std::string> rows;
    for (int64_t l = 0; l < L; ++l)
      for (int64_t h = 0; h < H; ++h)
        rows.push_back("L" + std::to_string(r.layers[static_cast<size_t>(l)]) + " H" + std::to_string(r.heads[static_cast<size_t>(h)]));
    HeatmapStyle style;
    style.title = "Each query's weight on its head's attention sink";
    style.row_labels = rows;
    style.col_labels = labels;
    style.row_axis = "layer, head";
    style.col_axis = "query token";
    style.vmax = 1.0;
    written.push_back(picture_path(dir + "/sinks", pictures));
    save_heatmap(written.back(), reshape(r.sink_share, {L * H, static_cast<int64_t>(labels.size())}), style, pictures);
  }
  if (r.routing.defined()) {  // one picture per routed layer: tokens × experts (past 32 experts, the ones chosen)
    const int64_t E = r.routing.size(2), T = r.routing.size(1);
    for (int64_t l = 0; l < r.routing.size(0); ++l) {
      const float* w = r.routing.data() + l * T * E;
      std::vector<int64_t> shown;
      for (int64_t e = 0; e < E; ++e) {
        bool chosen = false;
        for (int64_t t = 0; t < T && !chosen; ++t) chosen = w[t * E + e] > 0.0f;
        if (E <= 32 || chosen) shown.push_back(e);
      }
      Tensor cells = Tensor::empty({T, static_cast<int64_t>(shown.size())});
      HeatmapStyle style;
      for (size_t c = 0; c < shown.size(); ++c) {
        style.col_labels.push_back(std::to_string(shown[c]));
        for (int64_t t = 0; t < T; ++t) cells.data()[t * static_cast<int64_t>(shown.size()) + static_cast<int64_t>(c)] = w[t * E + shown[c]];
      }
      style.title = "Layer " + std::to_string(r.expert_layers[static_cast<size_t>(l)]) + ": each token's routing weights";
      if (static_cast<int64_t>(shown.size()) < E)
        style.caption = "the " + std::to_string(shown.size()) + " of " + std::to_string(E) + " experts some token chose";
      style.row_labels = labels;
      style.row_axis = "token";
      style.col_axis = "expert";
      style.vmax = 1.0;
      written.push_back(picture_path(dir + "/routing-layer" + two_digits(r.expert_layers[static_cast<size_t>(l)]), pictures));
      save_heatmap(written.back(), cells, style, pictures);
    }
  }
  std::string tokens_json = "[";
  for (size_t i = 0; i < r.tokens.size(); ++i) tokens_json += (i ? "," : "") + json_string(r.tokens[i]);
  tokens_json += "]";
  std::string layers_text, heads_text, kv_text, windows_text;
  for (int64_t l : r.layers) layers_text += (layers_text.empty() ? "" : ",") + std::to_string(l);
  for (int64_t h : r.heads) heads_text += (heads_text.empty() ? "" : ",") + std::to_string(h);
  for (size_t i = 0; i < r.heads.size(); ++i) kv_text += (i ? "," : "") + std::to_string(kv_head(r, i));
  for (size_t i = 0; i < r.layers.size(); ++i) windows_text += (i ? "," : "") + std::to_string(window_of(r, i));
  written.push_back(dir + "/attention.safetensors");
  std::vector<io::TensorData> tensors = {io::TensorData::from_tensor("attention", r.maps),
                                         io::TensorData::from_int64s("token_ids", r.token_ids)};
  std::map<std::string, std::string> metadata = {
      {"layers", layers_text}, {"heads", heads_text}, {"kv_heads", kv_text}, {"windows", windows_text},
      {"tokens", tokens_json}, {"title", r.title},
      {"layout", "attention[layer][head][query][key]; layers and heads are 1-based numbers"}};
  if (r.sink_share.defined()) tensors.push_back(io::TensorData::from_tensor("sink_share", r.sink_share));
  if (r.routing.defined()) {
    tensors.push_back(io::TensorData::from_tensor("routing", r.routing));
    std::string routed;
    for (int64_t l : r.expert_layers) routed += (routed.empty() ? "" : ",") + std::to_string(l);
    metadata["expert_layers"] = routed;
  }
  io::save_safetensors(written.back(), tensors, metadata);
  written.push_back(dir + "/attention.html");
  const std::string page = html_page(r);
  io::write_file_atomically(written.back(), std::span<const std::byte>(reinterpret_cast<const std::byte*>(page.data()), page.size()));
  return written;
}

}  // namespace qkv::viz
