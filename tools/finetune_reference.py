#!/usr/bin/python3
"""What the book's fine-tuning recipes compute in PyTorch, for the C++ tests to compare against.

  /usr/bin/python3 tools/finetune_reference.py [--out tests/fixtures]

Writes finetune.safetensors for a tiny GPT (the book's GPTModel, 2 layers, 4 heads, emb 32, vocab 97, T 16) made with
torch.manual_seed(123):
  classify.*  chapter 6: torch.manual_seed(123); out_head = Linear(32, 3); everything frozen but the last block, the
              final norm and the head; the loss on the last position; AdamW (lr 1e-3, weight decay 0.1), batch 4, two
              epochs over 12 texts in the order torch.randperm(12, generator seeded 123 + epoch) gives; the head's
              initial weights, every trainable gradient of the first step, the loss of every step, and the final
              accuracy;
  lora.*      appendix E's LinearWithLoRA (rank 2, alpha 4: (alpha / rank)·x·A·B) on every Linear of the blocks, the
              base frozen, the new head fully trained: the A matrices as drawn after the head, a forward and every
              gradient with B set to known values, and three AdamW steps;
  instruct.*  chapter 7's custom_collate_fn (pad 96, allowed_max_length 9, with and without the prompt masked) and
              three AdamW steps of full fine-tuning on its batch;
  randperm    torch.randperm(12, generator=torch.Generator().manual_seed(123)).

  /usr/bin/python3 tools/finetune_reference.py --check-written DIR [--check-written DIR2 …] --test TEST.csv [--base BASE.pth --adapter ADIR]

checks what qkv finetune classify wrote for a byte-level model: DIR/model.pth loads (weights_only, strict) into the book's
GPTModel built from DIR/config.json with model.out_head = torch.nn.Linear(emb_dim, classes), and classifying TEST.csv
as the book's classify_review does gives the test accuracy DIR/metrics.json reports. With --adapter, the book's
GPTModel of BASE.pth with appendix E's LinearWithLoRA holding the PEFT adapter's A and B (and its saved head) gives the
merged model.pth's logits.
"""
import argparse
import csv
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from gpt_reference import GPTModel, config_strings  # noqa: E402
from torch_reference import save_safetensors  # noqa: E402

CFG = {"vocab_size": 97, "context_length": 16, "emb_dim": 32, "n_heads": 4, "n_layers": 2, "drop_rate": 0.0,
       "qkv_bias": True}


class LoRALayer(torch.nn.Module):  # appendix E
    def __init__(self, in_dim, out_dim, rank, alpha):
        super().__init__()
        self.A = torch.nn.Parameter(torch.empty(in_dim, rank))
        torch.nn.init.kaiming_uniform_(self.A, a=math.sqrt(5))
        self.B = torch.nn.Parameter(torch.zeros(rank, out_dim))
        self.alpha, self.rank = alpha, rank

    def forward(self, x):
        return (self.alpha / self.rank) * (x @ self.A @ self.B)


class LinearWithLoRA(torch.nn.Module):
    def __init__(self, linear, rank, alpha):
        super().__init__()
        self.linear = linear
        self.lora = LoRALayer(linear.in_features, linear.out_features, rank, alpha)

    def forward(self, x):
        return self.linear(x) + self.lora(x)


def replace_linear_with_lora(model, rank, alpha, prefix="", skip=()):
    for name, module in model.named_children():
        full = prefix + name
        if full in skip:
            continue
        if isinstance(module, torch.nn.Linear):
            setattr(model, name, LinearWithLoRA(module, rank, alpha))
        else:
            replace_linear_with_lora(module, rank, alpha, full + ".", skip)


def base_model():
    torch.manual_seed(123)
    return GPTModel(CFG)


def classify(out):
    model = base_model()
    out.update({"param." + k: v.clone() for k, v in model.state_dict().items() if not k.endswith(".mask")})
    torch.manual_seed(123)
    model.out_head = torch.nn.Linear(CFG["emb_dim"], 3)
    out["classify.head_init.weight"] = model.out_head.weight.detach().clone()
    out["classify.head_init.bias"] = model.out_head.bias.detach().clone()
    for p in model.parameters():
        p.requires_grad = False
    for p in list(model.trf_blocks[-1].parameters()) + list(model.final_norm.parameters()) + list(model.out_head.parameters()):
        p.requires_grad = True
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, CFG["vocab_size"], (12, 10), generator=g)
    labels = torch.randint(0, 3, (12,), generator=g)
    out["classify.ids"], out["classify.labels"] = ids, labels
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    losses = []
    for epoch in range(2):
        order = torch.randperm(12, generator=torch.Generator().manual_seed(123 + epoch))
        for k in range(3):
            rows = order[4 * k:4 * k + 4]
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(ids[rows])[:, -1, :], labels[rows])
            loss.backward()
            if not losses:
                for name, p in model.named_parameters():
                    if p.requires_grad:
                        out["classify.grad." + name] = p.grad.clone()
            optimizer.step()
            losses.append(loss.item())
    out["classify.losses"] = torch.tensor(losses)
    with torch.no_grad():
        predicted = model(ids)[:, -1, :].argmax(-1)
    out["classify.accuracy"] = torch.tensor([(predicted == labels).float().mean().item()])
    out["classify.final.out_head.weight"] = model.out_head.weight.detach().clone()


def lora(out):
    model = base_model()
    torch.manual_seed(123)
    model.out_head = torch.nn.Linear(CFG["emb_dim"], 3)
    for p in model.parameters():
        p.requires_grad = False
    replace_linear_with_lora(model, rank=2, alpha=4, skip=("out_head",))
    for p in model.out_head.parameters():
        p.requires_grad = True
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    out["lora.trainable"] = torch.tensor([trainable])
    names = []
    for name, module in model.named_modules():
        if isinstance(module, LinearWithLoRA):
            names.append(name)
            out["lora.A_init." + name] = module.lora.A.detach().T.contiguous().clone()  # PEFT's (r, in)
    # B at known values so that every gradient is non-zero.
    g = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for name in names:
            module = model.get_submodule(name)
            module.lora.B.copy_(0.1 * torch.randn(module.lora.B.shape, generator=g))
            out["lora.B_set." + name] = module.lora.B.detach().T.contiguous().clone()  # PEFT's (out, r)
    ids = torch.randint(0, CFG["vocab_size"], (4, 10), generator=g)
    labels = torch.randint(0, 3, (4,), generator=g)
    out["lora.ids"], out["lora.labels"] = ids, labels
    logits = model(ids)[:, -1, :]
    out["lora.logits"] = logits.detach().clone()
    loss = torch.nn.functional.cross_entropy(logits, labels)
    loss.backward()
    for name in names:
        module = model.get_submodule(name)
        out["lora.grad_A." + name] = module.lora.A.grad.T.contiguous().clone()
        out["lora.grad_B." + name] = module.lora.B.grad.T.contiguous().clone()
    out["lora.grad.out_head.weight"] = model.out_head.weight.grad.clone()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    losses = []
    for _ in range(3):
        optimizer.zero_grad()
        step = torch.nn.functional.cross_entropy(model(ids)[:, -1, :], labels)
        step.backward()
        optimizer.step()
        losses.append(step.item())
    out["lora.losses"] = torch.tensor(losses)
    name = names[0]
    module = model.get_submodule(name)
    merged = module.linear.weight + (module.lora.alpha / module.lora.rank) * (module.lora.A @ module.lora.B).T
    out["lora.merged." + name] = merged.detach().clone()
    out["lora.final_B." + name] = module.lora.B.detach().T.contiguous().clone()


def custom_collate_fn(batch, pad_token_id, ignore_index=-100, allowed_max_length=None, prompt_lengths=None):
    batch_max_length = max(len(item) + 1 for item in batch)
    inputs_lst, targets_lst = [], []
    for i, item in enumerate(batch):
        new_item = item.copy()
        new_item += [pad_token_id]
        padded = new_item + [pad_token_id] * (batch_max_length - len(new_item))
        inputs = torch.tensor(padded[:-1])
        targets = torch.tensor(padded[1:])
        mask = targets == pad_token_id
        indices = torch.nonzero(mask).squeeze()
        if indices.numel() > 1:
            targets[indices[1:]] = ignore_index
        if prompt_lengths is not None:  # exercise 7.2: no loss on the prompt
            targets[:prompt_lengths[i] - 1] = ignore_index
        if allowed_max_length is not None:
            inputs = inputs[:allowed_max_length]
            targets = targets[:allowed_max_length]
        inputs_lst.append(inputs)
        targets_lst.append(targets)
    return torch.stack(inputs_lst), torch.stack(targets_lst)


def instruct(out):
    model = base_model()
    entries = [[5, 17, 3, 44, 8, 2], [9, 1, 30], [61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71], [12, 96, 4]]
    prompts = [3, 2, 5, 1]
    flat, lengths = [], []
    for e in entries:
        flat += e
        lengths.append(len(e))
    out["instruct.entries"], out["instruct.lengths"] = torch.tensor(flat), torch.tensor(lengths)
    out["instruct.prompt_tokens"] = torch.tensor(prompts)
    for masked in (False, True):
        inputs, targets = custom_collate_fn(entries, 96, allowed_max_length=9, prompt_lengths=prompts if masked else None)
        key = "instruct.masked." if masked else "instruct."
        out[key + "inputs"], out[key + "targets"] = inputs, targets
    inputs, targets = custom_collate_fn(entries, 96, allowed_max_length=9)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    losses = []
    for _ in range(3):
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    out["instruct.losses"] = torch.tensor(losses)


def read_safetensors(path):
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        assert info["dtype"] == "F32", name
        begin, end = info["data_offsets"]
        out[name] = torch.frombuffer(bytearray(data[begin:end]), dtype=torch.float32).reshape(info["shape"])
    return out


def classify_texts(model, texts, max_length, pad_id, pooling):
    """The book's classify_review for a byte-level tokenizer: cut, pad, the logits of the last (or last real) position."""
    rows = []
    with torch.no_grad():
        for text in texts:
            ids = list(text.encode("utf-8"))[:max_length]
            last = len(ids) - 1
            ids += [pad_id] * (max_length - len(ids))
            logits = model(torch.tensor(ids).unsqueeze(0))
            rows.append(logits[0, last if pooling == "last-real" else -1])
    return torch.stack(rows)


def check_written(args, directory):
    cfg = json.load(open(os.path.join(directory, "config.json")))
    metrics = json.load(open(os.path.join(directory, "metrics.json")))
    labels = metrics["labels"]
    model = GPTModel(cfg)
    model.out_head = torch.nn.Linear(cfg["emb_dim"], len(labels))
    model.load_state_dict(torch.load(os.path.join(directory, "model.pth"), weights_only=True))
    model.eval()
    with open(args.test, newline="") as f:
        rows = list(csv.DictReader(f))
    texts = [r["Text"] for r in rows]
    truth = torch.tensor([labels.index(r["Label"]) for r in rows])
    logits = classify_texts(model, texts, metrics["max_length"], metrics["pad_id"], metrics["pooling"])
    accuracy = (logits.argmax(-1) == truth).float().mean().item()
    reported = metrics["test"]["accuracy"]
    print(f"PyTorch's accuracy on {len(texts)} test texts: {accuracy:.4f}; qkv reported {reported:.4f}")
    assert abs(accuracy - reported) <= 1.0 / len(texts) + 1e-9, "the accuracies differ"
    if args.adapter and os.path.samefile(args.adapter, directory):
        config = json.load(open(os.path.join(args.adapter, "adapter_config.json")))
        weights = read_safetensors(os.path.join(args.adapter, "adapter_model.safetensors"))
        base = GPTModel(cfg)
        base.load_state_dict(torch.load(args.base, weights_only=True))
        base.out_head = torch.nn.Linear(cfg["emb_dim"], len(labels))
        prefix = "base_model.model."
        with torch.no_grad():
            base.out_head.weight.copy_(weights[prefix + "out_head.weight"])
            base.out_head.bias.copy_(weights[prefix + "out_head.bias"])
        replace_linear_with_lora(base, config["r"], config["lora_alpha"], skip=("out_head",))
        adapted = 0
        with torch.no_grad():
            for name, module in base.named_modules():
                if isinstance(module, LinearWithLoRA) and name in config["target_modules"]:
                    module.lora.A.copy_(weights[prefix + name + ".lora_A.weight"].T)
                    module.lora.B.copy_(weights[prefix + name + ".lora_B.weight"].T)
                    adapted += 1
        assert adapted == len(config["target_modules"]), "the adapter names modules the book's GPTModel does not have"
        base.eval()
        lora_logits = classify_texts(base, texts, metrics["max_length"], metrics["pad_id"], metrics["pooling"])
        diff = (lora_logits - logits).abs().max().item()
        print(f"the PEFT adapter on the base model in PyTorch gives the merged model's logits (max difference {diff:.2e})")
        assert diff < 1e-4
    print("the book's GPTModel reproduces qkv's fine-tuned classifier")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures"))
    # Several folders in one run (importing torch takes seconds): --adapter names the one whose adapter is checked too.
    parser.add_argument("--check-written", action="append")
    parser.add_argument("--test")
    parser.add_argument("--base")
    parser.add_argument("--adapter")
    args = parser.parse_args()
    if args.check_written:
        torch.set_num_threads(1)
        for directory in args.check_written:
            check_written(args, directory)
        return
    torch.set_num_threads(1)
    out = {}
    classify(out)
    lora(out)
    instruct(out)
    out["randperm"] = torch.randperm(12, generator=torch.Generator().manual_seed(123))
    save_safetensors(os.path.join(args.out, "finetune.safetensors"), out, config_strings(CFG, False))
    print(f"fine-tuning fixtures written to {os.path.normpath(args.out)}/finetune.safetensors")


if __name__ == "__main__":
    main()
