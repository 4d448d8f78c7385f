#!/usr/bin/env python3
"""Tiny random reward models saved by transformers, with the scores transformers gives them.

Usage:
    python3 tests/rollout/reward_model_reference.py OUT_DIR [QWEN3_TOKENIZER_DIR]

Writes, each folder saved by save_pretrained in float32 with num_labels=1:
  OUT_DIR/qwen2, OUT_DIR/llama   *ForSequenceClassification, vocab 97, pad_token_id 0, and reference.json:
      sequences      lists of ids in [1, 96] (no pad id inside), lengths 1 to 12
      single         AutoModelForSequenceClassification(ids[None]).logits[0, 0] of each sequence alone
      left, right    the sequences as one batch padded with 0 on that side: ids, mask (the attention
                     mask passed in), scores (logits[:, 0] of the batch)
  OUT_DIR/qwen3_chat (with QWEN3_TOKENIZER_DIR: a folder holding Qwen3's published tokenizer files)
      Qwen3ForSequenceClassification over that tokenizer's vocabulary, the tokenizer files copied in, and
      reference.json: conversations (messages, the last an assistant turn), their ids
      (apply_chat_template(messages, tokenize=False), then tokenizer(text, add_special_tokens=False)), and
      the scores of those ids.
Every model's weights come from a fixed seed: init_std 0.2, then p += 0.02 * randn_like(p) for every
parameter, so the scores are far from zero and differ between sequences.
"""

import json
import os
import shutil
import sys

import torch
from transformers import (
    AutoModelForSequenceClassification,
    AutoTokenizer,
    LlamaConfig,
    LlamaForSequenceClassification,
    Qwen2Config,
    Qwen2ForSequenceClassification,
    Qwen3Config,
    Qwen3ForSequenceClassification,
)

SHAPE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6, initializer_range=0.2,
             num_labels=1, tie_word_embeddings=False)


def perturbed(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=g))
    return model


def save(model, path):
    if os.path.exists(path):
        shutil.rmtree(path)
    model.save_pretrained(path, safe_serialization=True)


def scores(model, ids, mask=None):
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask)
    return out.logits[:, 0].tolist()


def padded(sequences, left):
    width = max(len(s) for s in sequences)
    ids, mask = [], []
    for s in sequences:
        pad = [0] * (width - len(s))
        ids.append(pad + s if left else s + pad)
        mask.append([0] * len(pad) + [1] * len(s) if left else [1] * len(s) + [0] * len(pad))
    return ids, mask


def tiny(out_dir, name, config_class, model_class, seed):
    torch.manual_seed(seed)
    config = config_class(vocab_size=97, pad_token_id=0, **SHAPE)
    path = os.path.join(out_dir, name)
    save(perturbed(model_class(config).eval(), seed), path)
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32,
                                                               attn_implementation="eager").eval()
    g = torch.Generator().manual_seed(seed + 1)
    sequences = [torch.randint(1, 97, (n,), generator=g).tolist() for n in (5, 1, 12, 7, 3)]
    ref = {"sequences": sequences, "single": [scores(model, torch.tensor([s]))[0] for s in sequences]}
    for side in ("left", "right"):
        ids, mask = padded(sequences, side == "left")
        ref[side] = {"ids": ids, "mask": mask, "scores": scores(model, torch.tensor(ids), torch.tensor(mask))}
    with open(os.path.join(path, "reference.json"), "w") as f:
        json.dump(ref, f)


def chat(out_dir, tokenizer_dir):
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(7)
    config = Qwen3Config(vocab_size=len(tok), pad_token_id=tok.pad_token_id, head_dim=8,
                         **dict(SHAPE, num_hidden_layers=1, hidden_size=16, intermediate_size=32))
    path = os.path.join(out_dir, "qwen3_chat")
    save(perturbed(Qwen3ForSequenceClassification(config).eval(), 7), path)
    for f in os.listdir(tokenizer_dir):
        if f.startswith("tokenizer") or f in ("special_tokens_map.json", "vocab.json", "merges.txt"):
            shutil.copy(os.path.join(tokenizer_dir, f), path)
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32,
                                                               attn_implementation="eager").eval()
    conversations = [
        [{"role": "user", "content": "What is 6 * 7?"},
         {"role": "assistant", "content": "6 * 7 = 42, so the answer is \\boxed{42}."}],
        [{"role": "system", "content": "You are a careful mathematician."},
         {"role": "user", "content": "Solve x^2 = 9 for x > 0."},
         {"role": "assistant", "content": "x = 3 — the positive root: \\boxed{3}"}],
        [{"role": "user", "content": "Say nothing."}, {"role": "assistant", "content": ""}],
    ]
    ref = {"conversations": conversations, "ids": [], "scores": []}
    for messages in conversations:
        text = tok.apply_chat_template(messages, tokenize=False)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        ref["ids"].append(ids)
        ref["scores"].append(scores(model, torch.tensor([ids]))[0])
    with open(os.path.join(path, "reference.json"), "w") as f:
        json.dump(ref, f)


def main():
    out_dir = sys.argv[1]
    os.makedirs(out_dir, exist_ok=True)
    tiny(out_dir, "qwen2", Qwen2Config, Qwen2ForSequenceClassification, 11)
    tiny(out_dir, "llama", LlamaConfig, LlamaForSequenceClassification, 12)
    if len(sys.argv) > 2:
        chat(out_dir, sys.argv[2])


if __name__ == "__main__":
    main()
