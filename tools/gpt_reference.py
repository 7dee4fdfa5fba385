#!/usr/bin/python3
"""The book's GPTModel (chapter 4) in PyTorch, and the GPT fixtures the C++ tests compare against.

  /usr/bin/python3 tools/gpt_reference.py [--out tests/fixtures]

Writes
  gpt_tiny.safetensors      a tiny GPT (2 layers, 4 heads, emb 32, vocab 97, T 16, batch 4) made with
                            torch.manual_seed(123): its state dict, inputs, targets, logits, loss, every
                            parameter gradient, and the losses of 10 AdamW steps;
  gpt_tiny_attention.safetensors  that model's attention weights (layers, heads, T, T) for its first sequence;
  gpt2_tiny_hf.safetensors  a tiny model of GPT-2's shape under Hugging Face's names (Conv1D c_attn
                            [in, out], tied wte), plus token ids and the logits PyTorch gives for them.
"""
import argparse
import os
import sys

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(__file__))
from torch_reference import MultiHeadAttention, save_safetensors  # noqa: E402


class LayerNorm(nn.Module):
    def __init__(self, emb_dim):
        super().__init__()
        self.eps = 1e-5
        self.scale = nn.Parameter(torch.ones(emb_dim))
        self.shift = nn.Parameter(torch.zeros(emb_dim))

    def forward(self, x):
        mean = x.mean(dim=-1, keepdim=True)
        var = x.var(dim=-1, keepdim=True, unbiased=False)
        return self.scale * (x - mean) / torch.sqrt(var + self.eps) + self.shift


class GELU(nn.Module):
    def forward(self, x):
        return 0.5 * x * (1 + torch.tanh(torch.sqrt(torch.tensor(2.0 / torch.pi)) * (x + 0.044715 * torch.pow(x, 3))))


class FeedForward(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(cfg["emb_dim"], 4 * cfg["emb_dim"]), GELU(),
                                    nn.Linear(4 * cfg["emb_dim"], cfg["emb_dim"]))

    def forward(self, x):
        return self.layers(x)


class TransformerBlock(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.att = MultiHeadAttention(d_in=cfg["emb_dim"], d_out=cfg["emb_dim"], context_length=cfg["context_length"],
                                      num_heads=cfg["n_heads"], dropout=cfg["drop_rate"], qkv_bias=cfg["qkv_bias"])
        self.ff = FeedForward(cfg)
        self.norm1 = LayerNorm(cfg["emb_dim"])
        self.norm2 = LayerNorm(cfg["emb_dim"])
        self.drop_shortcut = nn.Dropout(cfg["drop_rate"])

    def forward(self, x):
        shortcut = x
        x = self.drop_shortcut(self.att(self.norm1(x)))
        x = x + shortcut
        shortcut = x
        x = self.drop_shortcut(self.ff(self.norm2(x)))
        return x + shortcut


class GPTModel(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.tok_emb = nn.Embedding(cfg["vocab_size"], cfg["emb_dim"])
        self.pos_emb = nn.Embedding(cfg["context_length"], cfg["emb_dim"])
        self.drop_emb = nn.Dropout(cfg["drop_rate"])
        self.trf_blocks = nn.Sequential(*[TransformerBlock(cfg) for _ in range(cfg["n_layers"])])
        self.final_norm = LayerNorm(cfg["emb_dim"])
        self.out_head = nn.Linear(cfg["emb_dim"], cfg["vocab_size"], bias=False)

    def forward(self, in_idx):
        batch_size, seq_len = in_idx.shape
        x = self.tok_emb(in_idx) + self.pos_emb(torch.arange(seq_len, device=in_idx.device))
        x = self.drop_emb(x)
        x = self.trf_blocks(x)
        return self.out_head(self.final_norm(x))


def config_strings(cfg, tie):
    return {"vocab_size": str(cfg["vocab_size"]), "context_length": str(cfg["context_length"]),
            "emb_dim": str(cfg["emb_dim"]), "n_heads": str(cfg["n_heads"]), "n_layers": str(cfg["n_layers"]),
            "drop_rate": repr(float(cfg["drop_rate"])), "qkv_bias": "true" if cfg["qkv_bias"] else "false",
            "tie_weights": "true" if tie else "false"}


def tiny_parity(out_dir):
    cfg = {"vocab_size": 97, "context_length": 16, "emb_dim": 32, "n_heads": 4, "n_layers": 2, "drop_rate": 0.0,
           "qkv_bias": True}
    torch.manual_seed(123)
    model = GPTModel(cfg)
    tensors = {"param." + k: v.clone() for k, v in model.state_dict().items()}
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, cfg["vocab_size"], (4, 16), generator=g)
    targets = torch.randint(0, cfg["vocab_size"], (4, 16), generator=g)
    targets[0, :3] = -100  # ignored positions
    logits = model(ids)
    # What every head of every layer attends to, for the first sequence: (layers, heads, T, T).
    maps = torch.stack([block.att.last_weights[0] for block in model.trf_blocks])
    save_safetensors(os.path.join(out_dir, "gpt_tiny_attention.safetensors"), {"ids": ids[0], "attention": maps},
                     config_strings(cfg, False))
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
    loss.backward()
    tensors.update({"ids": ids, "targets": targets, "logits": logits.detach(), "loss": loss.detach().reshape(1)})
    for name, p in model.named_parameters():
        tensors["grad." + name] = p.grad.clone()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    losses = []
    for _ in range(10):
        optimizer.zero_grad()
        step_loss = torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), targets.flatten())
        step_loss.backward()
        optimizer.step()
        losses.append(step_loss.item())
    tensors["adamw_losses"] = torch.tensor(losses)
    save_safetensors(os.path.join(out_dir, "gpt_tiny.safetensors"), tensors, config_strings(cfg, False))


def tiny_hf_gpt2(out_dir):
    """A GPT-2-shaped model (qkv_bias, tied head) written under Hugging Face's GPT2Model names."""
    cfg = {"vocab_size": 101, "context_length": 24, "emb_dim": 48, "n_heads": 4, "n_layers": 3, "drop_rate": 0.0,
           "qkv_bias": True}
    torch.manual_seed(5)
    model = GPTModel(cfg)
    model.out_head.weight = model.tok_emb.weight
    with torch.no_grad():  # non-trivial norms so a mix-up of scale and shift would show
        for name, p in model.named_parameters():
            if name.endswith("scale") or name.endswith("shift"):
                p.add_(0.1 * torch.randn(p.shape))
    sd = model.state_dict()
    hf = {"wte.weight": sd["tok_emb.weight"], "wpe.weight": sd["pos_emb.weight"]}
    for i in range(cfg["n_layers"]):
        p = f"trf_blocks.{i}."
        h = f"h.{i}."
        hf[h + "ln_1.weight"], hf[h + "ln_1.bias"] = sd[p + "norm1.scale"], sd[p + "norm1.shift"]
        hf[h + "attn.bias"] = torch.tril(torch.ones(cfg["context_length"], cfg["context_length"])).view(
            1, 1, cfg["context_length"], cfg["context_length"])  # the old causal-mask buffer; loaders ignore it
        hf[h + "attn.c_attn.weight"] = torch.cat([sd[p + "att.W_query.weight"].T, sd[p + "att.W_key.weight"].T,
                                                  sd[p + "att.W_value.weight"].T], dim=1)
        hf[h + "attn.c_attn.bias"] = torch.cat([sd[p + "att.W_query.bias"], sd[p + "att.W_key.bias"],
                                                sd[p + "att.W_value.bias"]])
        hf[h + "attn.c_proj.weight"], hf[h + "attn.c_proj.bias"] = sd[p + "att.out_proj.weight"].T, sd[p + "att.out_proj.bias"]
        hf[h + "ln_2.weight"], hf[h + "ln_2.bias"] = sd[p + "norm2.scale"], sd[p + "norm2.shift"]
        hf[h + "mlp.c_fc.weight"], hf[h + "mlp.c_fc.bias"] = sd[p + "ff.layers.0.weight"].T, sd[p + "ff.layers.0.bias"]
        hf[h + "mlp.c_proj.weight"], hf[h + "mlp.c_proj.bias"] = sd[p + "ff.layers.2.weight"].T, sd[p + "ff.layers.2.bias"]
    hf["ln_f.weight"], hf["ln_f.bias"] = sd["final_norm.scale"], sd["final_norm.shift"]
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(0, cfg["vocab_size"], (2, 20), generator=g)
    with torch.no_grad():
        logits = model(ids)
    save_safetensors(os.path.join(out_dir, "gpt2_tiny_hf.safetensors"), {k: v.contiguous() for k, v in hf.items()},
                     {"format": "pt", "n_head": str(cfg["n_heads"])})
    save_safetensors(os.path.join(out_dir, "gpt2_tiny_hf.expected.safetensors"), {"ids": ids, "logits": logits})


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    tiny_parity(args.out)
    tiny_hf_gpt2(args.out)
    print(f"GPT fixtures written to {os.path.normpath(args.out)}")


if __name__ == "__main__":
    main()
