#!/usr/bin/python3
"""What PyTorch makes of a classifier folder qkv fine-tuned: transformers' <Family>ForSequenceClassification written
out (tools/decoder_reference.py's forward to the final norm, then score.weight at the last token that is not padding),
its accuracy and mean loss over labelled texts given as token ids.

  /usr/bin/python3 tools/classifier_reference.py FOLDER EXAMPLES.json

EXAMPLES.json: [{"ids": [...], "label": "name"}, …], the ids of each text as Hugging Face's tokenizer gives them (no
padding). Texts are cut and padded to metrics.json's max_length with config.json's pad_token_id, as qkv fine-tuned
them. Prints {"accuracy": …, "loss": …}.
"""
import json
import os
import struct
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from decoder_reference import forward  # noqa: E402


def load_safetensors(path):
    with open(path, "rb") as f:
        data = f.read()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        assert info["dtype"] == "F32", f"{name}: {info['dtype']}"
        begin, end = info["data_offsets"]
        out[name] = torch.frombuffer(bytearray(data[8 + n + begin:8 + n + end]), dtype=torch.float32).reshape(info["shape"])
    return out


def main():
    folder, examples_path = sys.argv[1:3]
    with open(os.path.join(folder, "config.json")) as f:
        c = json.load(f)
    assert c["architectures"][0].endswith("ForSequenceClassification"), c["architectures"]
    with open(os.path.join(folder, "metrics.json")) as f:
        length = json.load(f)["max_length"]
    w = load_safetensors(os.path.join(folder, "model.safetensors"))
    label2id, pad = c["label2id"], c["pad_token_id"]
    with open(examples_path) as f:
        examples = json.load(f)
    ids = torch.full((len(examples), length), pad, dtype=torch.int64)
    for i, e in enumerate(examples):
        row = e["ids"][:length]
        ids[i, :len(row)] = torch.tensor(row)
    labels = torch.tensor([label2id[e["label"]] for e in examples])
    with torch.no_grad():
        logits = forward(c, w, ids, hidden=True) @ w["score.weight"].t()  # (B, T, classes)
        # transformers: the rightmost token that is not padding
        non_pad = (ids != pad).int() * torch.arange(ids.shape[1])
        last = non_pad.argmax(-1)
        pooled = logits[torch.arange(len(examples)), last]
        loss = F.cross_entropy(pooled, labels).item()
        accuracy = (pooled.argmax(-1) == labels).float().mean().item()
    print(json.dumps({"accuracy": accuracy, "loss": loss}))


if __name__ == "__main__":
    main()
