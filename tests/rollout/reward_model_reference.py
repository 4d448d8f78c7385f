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
  OUT_DIR/qwen2_token, OUT_DIR/llama_token   *ForTokenClassification (num_labels 1, the critic's form), and
      reference.json: a toy PPO batch (prompts, responses, loss masks, rewards) and, in float64 through
      transformers and torch.optim.AdamW:
      values_old     the critic's values of each response token: logits[0, P + j - 1, 0] (the row that
                     predicts it), 0 off the loss mask
      advantages, returns   GAE(gamma, lam) over the sampled tokens (tool tokens skipped), returns = A + V
      steps          per optimizer step over the whole batch (num_iterations of them): the clipped value
                     loss 0.5 max((V - G)^2, (V_old + clip(V - V_old, +-c) - G)^2), seq-mean-token-mean,
                     its gradient norm before clipping, the clipped fraction of tokens
      values_after   the values after the last step
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
    AutoModelForTokenClassification,
    AutoTokenizer,
    LlamaConfig,
    LlamaForSequenceClassification,
    LlamaForTokenClassification,
    Qwen2Config,
    Qwen2ForSequenceClassification,
    Qwen2ForTokenClassification,
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


# The critic's toy batch: prompts, responses and their loss masks (0: a tool token), the reward on the last
# sampled token of each; and the update's settings.
BATCH = dict(
    prompts=[[5, 17, 3], [9, 2], [40, 41, 42, 43]],
    responses=[[7, 8, 60, 61, 9], [11, 12, 13], [20, 21, 70, 71, 22, 23]],
    masks=[[1, 1, 0, 0, 1], [1, 1, 1], [1, 0, 0, 1, 1, 1]],
    rewards=[1.0, -0.5, 0.25],
)
UPDATE = dict(gamma=0.99, lam=0.9, value_clip=0.02, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01,
              grad_clip=0.5, iterations=2)


def gae(rewards, values, mask, gamma, lam):
    """Advantages over the actions of one sequence, stepping over the tool tokens between them."""
    adv = [0.0] * len(mask)
    next_value = next_adv = 0.0
    for j in reversed(range(len(mask))):
        if not mask[j]:
            continue
        delta = rewards[j] + gamma * next_value - values[j]
        adv[j] = delta + gamma * lam * next_adv
        next_value, next_adv = values[j], adv[j]
    return adv


def critic_values(model):
    """Per sequence, the values of its response tokens (0 off the mask), differentiable."""
    out = []
    for prompt, response, mask in zip(BATCH["prompts"], BATCH["responses"], BATCH["masks"]):
        logits = model(input_ids=torch.tensor([prompt + response])).logits[0, :, 0]
        rows = torch.tensor([len(prompt) + j - 1 for j in range(len(response))])
        out.append(logits[rows] * torch.tensor(mask, dtype=logits.dtype))
    return out


def critic_update(model):
    u = UPDATE
    model = model.double().eval()  # no dropout: the trainer runs without it
    with torch.no_grad():
        old = [v.clone() for v in critic_values(model)]
    advantages, returns = [], []
    for v, mask, reward in zip(old, BATCH["masks"], BATCH["rewards"]):
        r = [0.0] * len(mask)
        r[max(j for j in range(len(mask)) if mask[j])] = reward
        a = gae(r, v.tolist(), mask, u["gamma"], u["lam"])
        advantages.append(a)
        returns.append([(a[j] + v[j].item()) * mask[j] for j in range(len(mask))])
    opt = torch.optim.AdamW(model.parameters(), lr=u["lr"], betas=(u["beta1"], u["beta2"]), eps=u["eps"],
                            weight_decay=u["weight_decay"])
    steps = []
    for _ in range(u["iterations"]):
        opt.zero_grad()
        loss, clipped, tokens = 0.0, 0.0, 0.0
        for v, v_old, g, mask in zip(critic_values(model), old, returns, BATCH["masks"]):
            g, m = torch.tensor(g, dtype=v.dtype), torch.tensor(mask, dtype=v.dtype)
            plain = (v - g) ** 2
            v_clip = v_old + (v - v_old).clamp(-u["value_clip"], u["value_clip"])
            worse = torch.maximum(plain, (v_clip - g) ** 2)
            clipped += (((v_clip - g) ** 2 > plain).double() * m).sum().item()
            tokens += m.sum().item()
            loss = loss + (0.5 * worse * m).sum() / m.sum()
        loss = loss / len(BATCH["masks"])
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), u["grad_clip"])
        opt.step()
        steps.append({"loss": loss.item(), "grad_norm": norm.item(), "clip_frac": clipped / tokens})
    assert steps[-1]["clip_frac"] > 0, "the value clip must act on the last step"
    with torch.no_grad():
        after = [v.tolist() for v in critic_values(model)]
    return {"batch": BATCH, "update": UPDATE, "values_old": [v.tolist() for v in old], "advantages": advantages,
            "returns": returns, "steps": steps, "values_after": after}


def token(out_dir, name, config_class, model_class, seed):
    torch.manual_seed(seed)
    config = config_class(vocab_size=97, pad_token_id=0, **SHAPE)
    path = os.path.join(out_dir, name)
    save(perturbed(model_class(config).eval(), seed), path)
    model = AutoModelForTokenClassification.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    with open(os.path.join(path, "reference.json"), "w") as f:
        json.dump(critic_update(model), f)


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
    token(out_dir, "qwen2_token", Qwen2Config, Qwen2ForTokenClassification, 13)
    token(out_dir, "llama_token", LlamaConfig, LlamaForTokenClassification, 14)
    if len(sys.argv) > 2:
        chat(out_dir, sys.argv[2])


if __name__ == "__main__":
    main()
