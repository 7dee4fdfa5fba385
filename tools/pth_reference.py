#!/usr/bin/python3
"""PyTorch .pth fixtures for qkv's reader and writer, made with Debian's python3-torch 1.13.

  /usr/bin/python3 tools/pth_reference.py [--out tests/fixtures/pth]   make the fixtures
  /usr/bin/python3 tools/pth_reference.py --check-written DIR          load what qkv wrote with PyTorch (a test):
      DIR/model.pth (weights_only=True, into the book's GPTModel, equal to the fixture's), DIR/model_and_optimizer.pth

Fixtures, all from the book's GPTModel (tools/gpt_reference.py) with a tiny configuration that the byte tokenizer
fits (vocab 256):
  model.pth                  torch.save(model.state_dict()), after 3 AdamW steps, as the book's chapter 5 does
  model_and_optimizer.pth    {"model_state_dict", "optimizer_state_dict"} at that point
  model.safetensors          the same state dict under the book's names, as safetensors
  config.json                the configuration as a reader pastes it from the book (Python's False, a trailing comma)
  expected.safetensors       every tensor of model_and_optimizer.pth (state.<name>, exp_avg.<name>, exp_avg_sq.<name>),
                             the optimizer's step, the 5 batches PyTorch trains on next and their losses, and
                             the loss of eval.txt under `qkv eval` rules (see eval_loss)
  eval.txt                   a short text for qkv eval
  model_half.pth, model_bf16.pth   the state dict in float16 and bfloat16
  views.pth                  views with offsets and strides, a transpose and shared storages, with views.expected.safetensors
  hostile/*.pth              files that must be refused, and hostile/expected.json: file → words the refusal names
"""
import argparse
import ast
import io
import json
import os
import pickle
import struct
import sys
import zipfile

import torch

sys.path.insert(0, os.path.dirname(__file__))
from gpt_reference import GPTModel  # noqa: E402
from torch_reference import save_safetensors  # noqa: E402

CFG = {"vocab_size": 256, "context_length": 16, "emb_dim": 16, "n_heads": 4, "n_layers": 2, "drop_rate": 0.0,
       "qkv_bias": False}
LR, WD = 4e-4, 0.1
BATCH = 2

EVAL_TEXT = ("In the beginning God created the heaven and the earth. And the earth was without form, and void; and "
             "darkness was upon the face of the deep. And the Spirit of God moved upon the face of the waters.\n")


def batch(g):
    ids = torch.randint(0, CFG["vocab_size"], (BATCH, CFG["context_length"] + 1), generator=g)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def train_step(model, optimizer, inputs, targets):
    optimizer.zero_grad()
    logits = model(inputs)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
    loss.backward()
    optimizer.step()
    return loss.item()


def eval_loss(model, ids, context, stride):
    """Perplexity with a sliding window (Hugging Face's recipe): windows of `context` tokens start every `stride`
    tokens; each token after the first is predicted once, from the window that first reaches it."""
    total, count, prev_end = 0.0, 0, 0
    for begin in range(0, len(ids) - 1, stride):
        end = min(begin + context, len(ids) - 1)
        x = torch.tensor(ids[begin:end]).unsqueeze(0)
        y = torch.tensor(ids[begin + 1:end + 1])
        fresh = end - max(prev_end, begin)  # targets not yet scored
        with torch.no_grad():
            losses = torch.nn.functional.cross_entropy(model(x)[0], y, reduction="none").double()
        total += losses[-fresh:].sum().item() if fresh > 0 else 0.0
        count += max(fresh, 0)
        prev_end = end
        if end == len(ids) - 1:
            break
    return total / count, count


def make_model_files(out):
    torch.manual_seed(123)
    model = GPTModel(CFG)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    g = torch.Generator().manual_seed(2024)
    for _ in range(3):
        train_step(model, optimizer, *batch(g))
    torch.save(model.state_dict(), os.path.join(out, "model.pth"))
    torch.save({"model_state_dict": model.state_dict(), "optimizer_state_dict": optimizer.state_dict()},
               os.path.join(out, "model_and_optimizer.pth"))
    save_safetensors(os.path.join(out, "model.safetensors"), dict(model.state_dict()))
    torch.save({k: v.half() for k, v in model.state_dict().items()}, os.path.join(out, "model_half.pth"))
    torch.save({k: v.bfloat16() for k, v in model.state_dict().items()}, os.path.join(out, "model_bf16.pth"))
    with open(os.path.join(out, "config.json"), "w") as f:  # pasted from a notebook: Python booleans, a comment
        f.write("{\n")
        for k, v in CFG.items():
            f.write(f'    "{k}": {v!r},  # {k}\n' if k != "qkv_bias" else f'    "{k}": {v!r},\n')
        f.write("}\n")
    expected = {}
    names = [n for n, _ in model.named_parameters()]
    for k, v in model.state_dict().items():
        expected["state." + k] = v.clone()
    sd = optimizer.state_dict()
    for i, name in enumerate(names):
        expected["exp_avg." + name] = sd["state"][i]["exp_avg"].clone()
        expected["exp_avg_sq." + name] = sd["state"][i]["exp_avg_sq"].clone()
    expected["step"] = torch.tensor([int(sd["state"][0]["step"])])
    # The next 5 steps, as the notebook would continue them.
    inputs, targets, losses = [], [], []
    for _ in range(5):
        x, y = batch(g)
        inputs.append(x)
        targets.append(y)
        losses.append(train_step(model, optimizer, x, y))
    expected["continue.inputs"] = torch.stack(inputs)
    expected["continue.targets"] = torch.stack(targets)
    expected["continue.losses"] = torch.tensor(losses, dtype=torch.float64)
    # qkv eval on eval.txt (byte tokens) with the saved model, at two strides.
    saved = GPTModel(CFG)
    saved.load_state_dict(torch.load(os.path.join(out, "model.pth")))
    saved.eval()
    with open(os.path.join(out, "eval.txt"), "w") as f:
        f.write(EVAL_TEXT)
    ids = list(EVAL_TEXT.encode())
    for stride in (16, 5):
        loss, count = eval_loss(saved, ids, CFG["context_length"], stride)
        expected[f"eval.stride{stride}"] = torch.tensor([loss, float(count)], dtype=torch.float64)
    meta = {k: str(v) for k, v in CFG.items()}
    save_safetensors(os.path.join(out, "expected.safetensors"), expected, meta)


def make_views(out):
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6) / 8
    views = {"base": base, "rows": base[1:3], "strided": base[:, ::2], "transposed": base.t(), "element": base[2, 3],
             "half_view": base.half()[1:, 1:]}
    torch.save(views, os.path.join(out, "views.pth"))
    save_safetensors(os.path.join(out, "views.expected.safetensors"),
                     {k: v.float().contiguous().reshape(v.shape) for k, v in views.items()})


# ---- hostile files ----

def zip_with(records, name="archive", compress=None):
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for rec, data in records:
            full = rec if rec.startswith("/") or rec.startswith(name + "/") else f"{name}/{rec}"
            kind = compress.get(rec, zipfile.ZIP_STORED) if compress else zipfile.ZIP_STORED
            z.writestr(zipfile.ZipInfo(full), data, compress_type=kind)
    return buf.getvalue()


def storage_pid(key, numel, cls=b"FloatStorage"):
    return (b"(X\x07\x00\x00\x00storage" + b"ctorch\n" + cls + b"\n" + b"X" + struct.pack("<I", len(key)) + key.encode() +
            b"X\x03\x00\x00\x00cpu" + b"J" + struct.pack("<i", numel) + b"tQ")


def tensor_pickle(key, numel, offset, size, stride):
    ints = lambda v: b"(" + b"".join(b"J" + struct.pack("<i", x) for x in v) + b"t"  # noqa: E731
    return (b"ctorch._utils\n_rebuild_tensor_v2\n(" + storage_pid(key, numel) + b"J" + struct.pack("<i", offset) +
            ints(size) + ints(stride) + b"\x89" + b"ccollections\nOrderedDict\n)R" + b"tR")


def dict_pickle(entries):
    body = b"".join(b"X" + struct.pack("<I", len(k)) + k.encode() + v for k, v in entries)
    return b"\x80\x02}(" + body + b"u."


class Evil:
    def __init__(self, fn, arg):
        self.fn, self.arg = fn, arg

    def __reduce__(self):
        return (self.fn, (self.arg,))


def make_hostile(out):
    os.makedirs(out, exist_ok=True)
    expected = {}

    def put(name, data, words):
        with open(os.path.join(out, name), "wb") as f:
            f.write(data)
        expected[name] = words

    good = tensor_pickle("0", 4, 0, [2, 2], [2, 1])
    four = struct.pack("<4f", 1, 2, 3, 4)
    marker = "/tmp/qkv-pwned"
    put("os_system.pth", zip_with([("data.pkl", pickle.dumps(Evil(os.system, f"touch {marker}"), protocol=2)),
                                   ("version", b"3\n")]), ["posix.system"])
    put("builtins_eval.pth", zip_with([("data.pkl", pickle.dumps(Evil(eval, "print('pwned')"), protocol=2)),
                                       ("version", b"3\n")]), ["__builtin__.eval"])
    put("stack_global_exec.pth", zip_with([("data.pkl", pickle.dumps(Evil(exec, "x=1"), protocol=4)),
                                           ("version", b"3\n")]), ["builtins.exec"])
    put("subprocess.pth", zip_with([("data.pkl", b"\x80\x02csubprocess\ncheck_output\n(X\x02\x00\x00\x00idtR."),
                                    ("version", b"3\n")]), ["subprocess.check_output"])
    buf = io.BytesIO()
    torch.save(torch.nn.Linear(2, 2), buf)  # a whole module: its class is a global
    put("whole_module.pth", buf.getvalue(), ["torch.nn.modules.linear.Linear", "state_dict"])
    put("newobj.pth", zip_with([("data.pkl", b"\x80\x02ccollections\nOrderedDict\n)\x81."), ("version", b"3\n")]),
        ["0x81", "class"])
    put("inst.pth", zip_with([("data.pkl", b"(ios\nsystem\nX\x02\x00\x00\x00id."), ("version", b"3\n")]),
        ["('i')", "class"])
    put("deep_lists.pth", zip_with([("data.pkl", b"\x80\x02" + b"]" * 5000 + b"a" * 4999 + b"."),
                                    ("version", b"3\n")]), ["nested deeper"])
    put("deep_marks.pth", zip_with([("data.pkl", b"\x80\x02" + b"(" * 5000 + b"."), ("version", b"3\n")]),
        ["nested deeper"])
    put("missing_storage.pth", zip_with([("data.pkl", dict_pickle([("w", tensor_pickle("7", 4, 0, [2, 2], [2, 1]))])),
                                         ("data/0", four), ("version", b"3\n")]), ["storage 7", "no entry"])
    put("short_storage.pth", zip_with([("data.pkl", dict_pickle([("w", tensor_pickle("0", 1000, 0, [10, 100], [100, 1]))])),
                                       ("data/0", four), ("version", b"3\n")]), ["1000 elements", "16 bytes"])
    put("view_past_storage.pth", zip_with([("data.pkl", dict_pickle([("w", tensor_pickle("0", 4, 3, [2, 2], [2, 1]))])),
                                           ("data/0", four), ("version", b"3\n")]), ["reaches element 6"])
    put("negative_stride.pth", zip_with([("data.pkl", dict_pickle([("w", tensor_pickle("0", 4, 0, [2, 2], [-2, 1]))])),
                                         ("data/0", four), ("version", b"3\n")]), ["negative size or stride"])
    put("overflowing_view.pth", zip_with([("data.pkl", dict_pickle([("w", tensor_pickle("0", 4, 0, [2**31 - 1, 2**31 - 1, 2**31 - 1],
                                                                                        [2**31 - 1, 2**31 - 1, 2**31 - 1]))])),
                                          ("data/0", four), ("version", b"3\n")]), ["overflow"])
    put("dotdot.pth", zip_with([("data.pkl", dict_pickle([("w", good)])), ("data/0", four),
                                ("archive/../../../etc/passwd", b"root"), ("version", b"3\n")]), ["'..'"])
    put("absolute_name.pth", zip_with([("/etc/cron.d/qkv", b"* * * * * root id"), ("data.pkl", dict_pickle([("w", good)])),
                                       ("data/0", four), ("version", b"3\n")]), ["absolute"])
    zeros = bytes(64 << 20)  # 64 MB of zeros deflate to about 64 KB
    put("zip_bomb.pth", zip_with([("data.pkl", dict_pickle([("w", tensor_pickle("0", 16 << 20, 0, [16 << 20], [1]))])),
                                  ("data/0", zeros), ("version", b"3\n")], compress={"data/0": zipfile.ZIP_DEFLATED}),
        ["compressed"])
    put("pickle_bomb.pth", zip_with([("data.pkl", b"\x80\x02N" + bytes(20 << 20)), ("version", b"3\n")],
                                    compress={"data.pkl": zipfile.ZIP_DEFLATED}), ["data.pkl is", "bytes"])
    with open(os.path.join(os.path.dirname(out), "model.pth"), "rb") as f:
        whole = f.read()
    put("truncated.pth", whole[: len(whole) // 2], ["zip"])
    put("not_a_zip.pth", b"hello, I am a text file pretending to be a checkpoint\n", ["not a PyTorch .pth"])
    buf = io.BytesIO()
    torch.save({"w": torch.ones(2)}, buf, _use_new_zipfile_serialization=False)
    put("legacy_format.pth", buf.getvalue(), ["legacy format"])
    buf = io.BytesIO()
    torch.jit.save(torch.jit.script(torch.nn.Linear(2, 2)), buf)
    put("torchscript.pt", buf.getvalue(), ["TorchScript"])
    put("truncated_pickle.pth", zip_with([("data.pkl", dict_pickle([("w", good)])[:-20]), ("data/0", four),
                                          ("version", b"3\n")]), ["truncated"])
    put("memo_before_put.pth", zip_with([("data.pkl", b"\x80\x02h\x05."), ("version", b"3\n")]), ["memo entry 5"])
    put("bad_persistent_id.pth", zip_with([("data.pkl", b"\x80\x02(X\x06\x00\x00\x00moduleX\x01\x00\x00\x00xtQ."),
                                           ("version", b"3\n")]), ["persistent id"])
    put("storage_key_path.pth", zip_with([("data.pkl", dict_pickle([("w", tensor_pickle("../0", 4, 0, [2, 2], [2, 1]))])),
                                          ("version", b"3\n")]), ["not a plain name"])
    put("list_as_key.pth", zip_with([("data.pkl", b"\x80\x02}]K\x01s."), ("version", b"3\n")]), ["dict key"])
    put("huge_long.pth", zip_with([("data.pkl", b"\x80\x02\x8a\x10" + bytes(16) + b"."), ("version", b"3\n")]),
        ["64 bits"])
    put("no_data_pkl.pth", zip_with([("version", b"3\n")]), ["without data.pkl"])
    with open(os.path.join(out, "expected.json"), "w") as f:
        json.dump(expected, f, indent=1, sort_keys=True)
        f.write("\n")
    return len(expected)


def check_written(directory, fixtures):
    """What qkv wrote, read by PyTorch: weights_only for the state dict, the book's GPTModel loading it."""
    with open(os.path.join(directory, "config.json")) as f:
        cfg = ast.literal_eval(f.read())  # the book's dict, Python syntax
    sd = torch.load(os.path.join(directory, "model.pth"), weights_only=True)
    model = GPTModel(cfg)
    model.load_state_dict(sd)  # strict: every key, every shape
    expected = torch.load(os.path.join(fixtures, "model.pth"))
    for k, v in expected.items():
        if not torch.equal(sd[k], v):
            raise SystemExit(f"{k} differs")
    both = torch.load(os.path.join(directory, "model_and_optimizer.pth"))
    model.load_state_dict(both["model_state_dict"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1.0)
    optimizer.load_state_dict(both["optimizer_state_dict"])
    group = optimizer.param_groups[0]
    print(f"torch.load: {len(sd)} tensors (weights_only=True), the book's GPTModel loads them; optimizer "
          f"lr={group['lr']} weight_decay={group['weight_decay']} step={int(optimizer.state_dict()['state'][0]['step'])}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "pth"))
    parser.add_argument("--check-written", metavar="DIR")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.check_written:
        check_written(args.check_written, args.out)
        return
    os.makedirs(args.out, exist_ok=True)
    make_model_files(args.out)
    make_views(args.out)
    n = make_hostile(os.path.join(args.out, "hostile"))
    print(f".pth fixtures written to {os.path.normpath(args.out)} ({n} hostile files)")


if __name__ == "__main__":
    main()
