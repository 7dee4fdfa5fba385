// A GGUF file as node-llama-cpp (llama.cpp's npm package) reads it with its own JS parser, readGgufFileInfo:
// version, metadata (keys flattened back to "a.b.c"), tensor table and where the data section starts, printed as
// JSON for tests/test_gguf.cpp to compare with what qkv wrote. 64-bit integers (BigInt) print as decimal strings.
// Usage: node gguf_llamacpp_info.js NODE_MODULES FILE
const path = require("path");
const [modules, file] = process.argv.slice(2);

// node-llama-cpp nests "a.b.c" keys into objects; undo it (the arrays are values, not nesting).
function flatten(object, prefix, out) {
  for (const [key, value] of Object.entries(object)) {
    const name = prefix ? prefix + "." + key : key;
    if (value !== null && typeof value === "object" && !Array.isArray(value)) flatten(value, name, out);
    else out[name] = value;
  }
  return out;
}

(async () => {
  const { readGgufFileInfo } = await import(path.join(modules, "node-llama-cpp", "dist", "index.js"));
  const info = await readGgufFileInfo(file, { sourceType: "filesystem", logWarnings: false });
  const result = {
    version: info.version,
    tensorCount: info.tensorCount,
    dataOffset: info.infoEndOffset,
    metadata: flatten(info.metadata, "", {}),
    tensors: info.tensorInfo.map((t) => ({ name: t.name, dims: t.dimensions, type: t.ggmlType, offset: t.offset })),
  };
  process.stdout.write(JSON.stringify(result, (_, v) => (typeof v === "bigint" ? v.toString() : v)) + "\n");
})().catch((error) => {
  process.stderr.write(String(error && error.stack ? error.stack : error) + "\n");
  process.exit(1);
});
