#!/usr/bin/python3
"""A tiny random model of each family with the real tokenizer (vocabulary of the real size), as a Hugging Face
folder, and what PyTorch says of it: the mean next-token loss over given token ids and a greedy continuation.
All families in one process (importing torch costs seconds): tests/hf_cli_prepare.js runs it for hf_cli_check.sh.

  /usr/bin/python3 tools/decoder_cli_reference.py WORK_DIR FAMILY TOKENIZER_DIR [FAMILY TOKENIZER_DIR ...]

TOKENIZER_DIR holds tokenizer.json and tokenizer_config.json (copied into the folder); WORK_DIR/FAMILY.ids.json holds
{"text": [ids], "prompt": [ids]} from Hugging Face's tokenizers (transformers.js). Writes the folder WORK_DIR/FAMILY/
and its expected.json: {"loss": …, "greedy": [ids], "tokens": …}.
"""
import json
import os
import shutil
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from decoder_reference import FAMILIES, forward, random_weights, write_folder  # noqa: E402


def make(family, tokenizer_dir, out, ids_file):
    with open(os.path.join(tokenizer_dir, "tokenizer.json")) as f:
        t = json.load(f)
    vocab = max(list(t["model"]["vocab"].values()) + [a["id"] for a in t.get("added_tokens", [])]) + 1
    with open(os.path.join(tokenizer_dir, "tokenizer_config.json")) as f:
        tc = json.load(f)
    c = dict(FAMILIES[family])
    c["vocab_size"] = vocab
    c["max_position_embeddings"] = 4096
    eos = tc.get("eos_token")
    eos = eos["content"] if isinstance(eos, dict) else eos
    ids_of = {a["content"]: a["id"] for a in t.get("added_tokens", [])}
    if eos in ids_of:
        c["eos_token_id"] = ids_of[eos]
    w = random_weights(c, 77)
    write_folder(c, w, out, shards=1)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(tokenizer_dir, name), os.path.join(out, name))
    with open(ids_file) as f:
        given = json.load(f)
    ids = torch.tensor([given["text"]])
    prompt = given["prompt"]
    with torch.no_grad():
        logits = forward(c, w, ids[:, :-1])
        loss = F.cross_entropy(logits[0], ids[0, 1:]).item()
        sequence = list(prompt)
        for _ in range(8):
            token = int(forward(c, w, torch.tensor([sequence]))[0, -1].argmax())
            if token == c.get("eos_token_id"):
                break
            sequence.append(token)
    with open(os.path.join(out, "expected.json"), "w") as f:
        json.dump({"loss": loss, "greedy": sequence[len(prompt):], "tokens": ids.shape[1]}, f)
    print(f"{family}: vocabulary {vocab}, {ids.shape[1]} tokens, loss {loss:.6f}, greedy {sequence[len(prompt):]}")


def main():
    work, pairs = sys.argv[1], sys.argv[2:]
    if not pairs or len(pairs) % 2:
        sys.exit(__doc__)
    for family, tokenizer_dir in zip(pairs[::2], pairs[1::2]):
        make(family, tokenizer_dir, os.path.join(work, family), os.path.join(work, family + ".ids.json"))


if __name__ == "__main__":
    main()
