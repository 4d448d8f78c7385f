#!/usr/bin/env python3
"""TRL's GRPOTrainer as the end-to-end peer of grpo_train: GRPO steps on a Hugging Face checkpoint folder,
timed step by step, with the settings of configs/retool.yaml with tools off.

Generation uses TRL's transformers `generate` backend (no vLLM); one device; no reference model (beta 0,
like objective.kl_coef 0). Each optimizer step samples prompts_per_step x samples completions, scores them
with a boxed-answer reward and takes one AdamW step over them in micro-batches: one RL step of ours.

Per step it records: the step time (a TrainerCallback, from on_step_begin to on_step_end, the device
synchronized at both ends), the generation time within it (until the reward function is called, which TRL
does right after generate returns), the completion tokens sampled (the reward function's completion_ids,
cut after the first EOS as TRL cuts them), sampled tokens/s = those tokens / step time, and the caching
allocator's peak (max_memory_allocated, reset at each step's start; also that peak minus what was
allocated at the step's start, grpo_train's `peak_memory_*_mib` form, and max_memory_reserved). The JSON
holds every step, the steady-state means (steps after the first) and the settings in use.

Settings, TRL name = our config key (configs/retool.yaml with rollout.tools false):
  num_generations               = sampling.samples_per_prompt (G)
  generation_batch_size         = train.prompts_per_step x G (one generate call a step)
  per_device_train_batch_size   = train.micro_batch_size (sequences per forward/backward)
  gradient_accumulation_steps   = prompts_per_step x G / micro_batch_size (one optimizer step a step:
                                  train.mini_batch_size 0)
  max_completion_length         = sampling.max_new_tokens (one turn: tools off)
  temperature, top_p, top_k     = sampling.temperature 1, top_p 1, top_k 0
  num_iterations                = train.num_iterations 1 (TRL takes the current log-probs, detached, as
                                  the old ones: no scoring forward; ours takes the rollout's, and scores
                                  once a step when they differ by more than train.old_logprobs_tol)
  beta                          = objective.kl_coef 0 (no reference model)
  epsilon, epsilon_high         = objective.clip_eps_low 0.2, objective.clip_eps_high 0.28
  loss_type grpo                = objective.agg seq-mean-token-mean (each sequence's token mean, averaged)
  scale_rewards group           = train.scale_rewards group
  mask_truncated_completions    = train.mask_truncated false
  learning_rate, adam_beta1/2,  = train.lr 1e-6, beta1 0.9, beta2 0.98, adam_eps 1e-8, weight_decay 0.1
    adam_epsilon, weight_decay
  lr_scheduler_type constant    = train.lr_schedule constant, warmup 0
  max_grad_norm                 = train.grad_clip 1
  gradient_checkpointing        = model.activation_checkpointing true
  bf16 with float32 weights     = model.dtype bfloat16 with train.master_weights fp32: TRL's default loads
                                  the checkpoint in float32 and runs forwards under bf16 autocast, so its
                                  AdamW steps fp32 weights as ours steps fp32 masters (--dtype bfloat16:
                                  bf16 weights and moments, our train.master_weights none)
  reward: boxed_reward below    = reward.kind boxed, correct 1, wrong -1
  the checkpoint's chat template, the system turn = chat.template model, chat.system (chat.tools empty)

Differences that remain: TRL decodes the whole batch in lockstep with a growing KV cache until every row
stops, then trains; prompt order differs (both shuffle with their own seed); TRL's weight decay skips
biases and norm weights; TRL stops at the tokenizer's EOS (transformers replaces generation_config.json's
with it), ours at both (a random checkpoint samples neither, so every completion runs to the limit on both
sides); the reward compares numbers past 128 bits exactly where ours compares them as strings.

Usage: python3 scripts/bench_grpo_peer.py --model CKPT_DIR --data data/dapo-math-17k-200.jsonl \
         --json trl.json [--steps 3 --prompts-per-step 32 --samples 8 --max-new-tokens 512 ...]
"""

import argparse
import json
import math
import os
import sys
import tempfile
import time
from fractions import Fraction

# ---- The boxed-answer reward: data/reward.cpp's extract_last_boxed, normalize_answer, answers_match ----


def _match_brace(s, open_):
    """Index just past the '}' closing the '{' at open_, or -1; a backslash escapes the next character."""
    depth, i = 0, open_
    while i < len(s):
        c = s[i]
        if c == "\\":
            i += 1
        elif c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return -1


def _find_command(s, cmd, start=0):
    """Where the LaTeX command cmd starts at or after start as a whole command (\\left not in \\leftarrow)."""
    p = s.find(cmd, start)
    while p != -1:
        end = p + len(cmd)
        if end >= len(s) or not s[end].isalpha() or not cmd[-1].isalpha():
            return p
        p = s.find(cmd, p + 1)
    return -1


def extract_last_boxed(text):
    """Content of the last \\boxed{...}; None when there is none or the last one never closes."""
    last, p = None, _find_command(text, "\\boxed")
    while p != -1:
        open_ = p + len("\\boxed")
        while open_ < len(text) and text[open_] in " \t\n":
            open_ += 1
        if open_ >= len(text) or text[open_] != "{":
            p = _find_command(text, "\\boxed", open_)
            continue
        end = _match_brace(text, open_)
        if end == -1:
            return None  # the last box runs to the end: a truncated answer
        last = text[open_ + 1 : end - 1]
        p = _find_command(text, "\\boxed", end)
    return last


def _replace_command(s, cmd, by):
    p = _find_command(s, cmd)
    while p != -1:
        s = s[:p] + by + s[p + len(cmd) :]
        p = _find_command(s, cmd, p + len(by))
    return s


def _unwrap_command(s, cmd):
    p = _find_command(s, cmd)
    while p != -1:
        open_ = p + len(cmd)
        end = _match_brace(s, open_) if open_ < len(s) and s[open_] == "{" else -1
        if end == -1:
            p = _find_command(s, cmd, p + len(cmd))
            continue
        s = s[:p] + s[open_ + 1 : end - 1] + s[end:]
        p = _find_command(s, cmd, p)
    return s


def _read_argument(s, i):
    """One LaTeX argument at i: a {group} (its content), a control word, or one character; (arg, next) or None."""
    if i >= len(s) or s[i] == "}":
        return None
    if s[i] == "{":
        end = _match_brace(s, i)
        return None if end == -1 else (s[i + 1 : end - 1], end)
    j = i + 1
    if s[i] == "\\":
        while j < len(s) and s[j].isalpha():
            j += 1
        if j == i + 1 and j < len(s):
            j += 1
    return s[i:j], j


def _brace_frac_arguments(s):
    p = _find_command(s, "\\frac")
    while p != -1:
        num = _read_argument(s, p + 5)
        den = _read_argument(s, num[1]) if num else None
        if num and den:
            s = s[:p] + "\\frac{" + num[0] + "}{" + den[0] + "}" + s[den[1] :]
        p = _find_command(s, "\\frac", p + 5)
    return s


def _digits(s):
    return s != "" and all("0" <= c <= "9" for c in s)


def _has_thousands_commas(s):
    body = s[1:] if s.startswith("-") else s
    point = body.find(".")
    int_part, frac = (body, "") if point == -1 else (body[:point], body[point + 1 :])
    if point != -1 and not _digits(frac):
        return False
    groups = int_part.split(",")
    return (
        len(groups) > 1
        and 1 <= len(groups[0]) <= 3
        and _digits(groups[0])
        and all(len(g) == 3 and _digits(g) for g in groups[1:])
    )


def _canonical_decimal(s):
    negative = s.startswith("-")
    body = s[1:] if negative else s
    int_part, _, frac_part = body.partition(".")
    if (int_part and not _digits(int_part)) or (frac_part and not _digits(frac_part)) or not (int_part or frac_part):
        return s
    if "." in body and body.count(".") > 1:
        return s
    int_part = int_part.lstrip("0") or "0"
    frac_part = frac_part.rstrip("0")
    out = int_part + ("." + frac_part if frac_part else "")
    return "-" + out if negative and out != "0" else out


def normalize_answer(s):
    s = s.replace("\u2212", "-")
    for cmd in ("\\left", "\\right", "\\displaystyle", "\\quad", "\\qquad"):
        p = _find_command(s, cmd)
        while p != -1:
            s = s[:p] + s[p + len(cmd) :]
            p = _find_command(s, cmd, p)
    for spacing in ("\\,", "\\;", "\\:", "\\!", "\\ ", "~", "$"):
        s = s.replace(spacing, "")
    s = "".join(c for c in s if not c.isspace())
    for wrapper in ("\\text", "\\textbf", "\\mathrm", "\\mbox"):
        s = _unwrap_command(s, wrapper)
    s = _replace_command(s, "\\dfrac", "\\frac")
    s = _replace_command(s, "\\tfrac", "\\frac")
    s = _brace_frac_arguments(s)
    if s.endswith("."):
        s = s[:-1]
    if len(s) > 1 and s[0] == "+":
        s = s[1:]
    plain = s.replace("{,}", ",")
    if _has_thousands_commas(plain):
        s = plain.replace(",", "")
    return _canonical_decimal(s)


def _signed_int(s):
    return int(s) if _digits(s[1:] if s.startswith("-") else s) else None


def _rational(s):
    """A normalised answer as an exact Fraction (integer, decimal, a/b, \\frac{a}{b}), else None."""
    negative = s.startswith("-")
    body = s[1:] if negative else s
    if body.startswith("\\frac{"):
        num_end = _match_brace(body, 5)
        if num_end == -1 or num_end >= len(body) or body[num_end] != "{" or _match_brace(body, num_end) != len(body):
            return None
        num, den = _signed_int(body[6 : num_end - 1]), _signed_int(body[num_end + 1 : -1])
    elif "/" in body:
        a, _, b = body.partition("/")
        num, den = _signed_int(a), _signed_int(b)
    else:
        int_part, _, frac_part = body.partition(".")
        if not _digits(int_part) or ("." in body and not _digits(frac_part)):
            return None
        num, den = int(int_part + frac_part), 10 ** len(frac_part)
    if num is None or den is None or den == 0:
        return None
    return Fraction(-num if negative else num, den)


def answers_match(predicted, reference):
    p, r = normalize_answer(predicted), normalize_answer(reference)
    if not p or not r:
        return False
    if p == r:
        return True
    a, b = _rational(p), _rational(r)
    return a is not None and b is not None and a == b


def boxed_reward(text, reference, correct=1.0, wrong=-1.0):
    """reward.kind boxed: `correct` when the last box matches the reference, else `wrong` (no box included)."""
    box = extract_last_boxed(text)
    ok = box is not None and normalize_answer(box) != "" and answers_match(box, reference)
    return correct if ok else wrong


# ---- The benchmark ----


def load_prompts(path, prompt_key, answer_key, system, limit):
    """JSONL rows as TRL conversational prompts: the row's messages (or one user turn holding a string
    prompt), with `system` as a system turn in front when the row has none, as grpo_train's encode_chat."""
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            prompt = row[prompt_key]
            answer = row
            for part in answer_key.split("."):
                answer = answer[part]
            msgs = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
            if not msgs or not all(isinstance(m, dict) and "role" in m and "content" in m for m in msgs):
                sys.exit(f"{path}:{n}: '{prompt_key}' is neither a string nor a list of {{role, content}} messages")
            if system and msgs[0]["role"] != "system":
                msgs = [{"role": "system", "content": system}] + msgs
            rows.append({"prompt": [{"role": m["role"], "content": m["content"]} for m in msgs], "answer": str(answer)})
            if limit and len(rows) >= limit:
                break
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="Hugging Face checkpoint folder (config, safetensors, tokenizer)")
    ap.add_argument("--data", required=True, help="JSONL prompts, e.g. data/dapo-math-17k-200.jsonl")
    ap.add_argument("--prompt-key", default="prompt", help="data.prompt_key")
    ap.add_argument("--answer-key", default="label", help="data.answer_key (dotted paths reach nested keys)")
    ap.add_argument("--system", default="", help="chat.system: a system turn for rows that have none")
    ap.add_argument("--max-rows", type=int, default=0, help="read at most this many rows (0 = all)")
    ap.add_argument("--steps", type=int, default=3, help="train.steps")
    ap.add_argument("--prompts-per-step", type=int, default=32, help="train.prompts_per_step")
    ap.add_argument("--samples", type=int, default=8, help="sampling.samples_per_prompt (G)")
    ap.add_argument("--max-new-tokens", type=int, default=512, help="sampling.max_new_tokens")
    ap.add_argument("--micro-batch", type=int, default=8, help="train.micro_batch_size")
    ap.add_argument("--temperature", type=float, default=1.0, help="sampling.temperature")
    ap.add_argument("--lr", type=float, default=1e-6, help="train.lr")
    ap.add_argument("--beta1", type=float, default=0.9, help="train.beta1")
    ap.add_argument("--beta2", type=float, default=0.98, help="train.beta2")
    ap.add_argument("--adam-eps", type=float, default=1e-8, help="train.adam_eps")
    ap.add_argument("--weight-decay", type=float, default=0.1, help="train.weight_decay")
    ap.add_argument("--grad-clip", type=float, default=1.0, help="train.grad_clip")
    ap.add_argument("--clip-low", type=float, default=0.2, help="objective.clip_eps_low")
    ap.add_argument("--clip-high", type=float, default=0.28, help="objective.clip_eps_high")
    ap.add_argument("--no-checkpointing", action="store_true", help="model.activation_checkpointing false")
    ap.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="weights as loaded: float32 (TRL's default; bf16 autocast, fp32 AdamW) or bfloat16 (bf16 AdamW)",
    )
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--seed", type=int, default=0, help="train.seed")
    ap.add_argument("--json", required=True, help="where the results go")
    a = ap.parse_args()

    rows_per_step = a.prompts_per_step * a.samples
    if a.samples < 2:
        sys.exit("--samples: GRPO needs at least 2 completions per prompt")
    if rows_per_step % a.micro_batch != 0:
        sys.exit(f"--micro-batch {a.micro_batch} must divide prompts-per-step x samples = {rows_per_step}")

    import torch
    import transformers
    import trl
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    cuda = a.device == "cuda"
    if cuda and not torch.cuda.is_available():
        sys.exit("--device cuda: no CUDA device (use --device cpu)")

    def sync():
        if cuda:
            torch.cuda.synchronize()

    rows = load_prompts(a.data, a.prompt_key, a.answer_key, a.system, a.max_rows)
    if len(rows) < a.prompts_per_step:
        sys.exit(f"{a.data}: {len(rows)} rows, fewer than --prompts-per-step {a.prompts_per_step}")
    dataset = Dataset.from_list(rows)

    class StepTimer(TrainerCallback):
        """Times each optimizer step (generation, reward, forward/backward, AdamW) and reads its peak memory."""

        def __init__(self):
            self.steps, self.t0, self.t_gen, self.tokens, self.lengths, self.rewards = [], None, None, 0, [], []
            self.write = lambda: None

        def on_step_begin(self, args, state, control, **kw):
            sync()
            if cuda:
                torch.cuda.reset_peak_memory_stats()
                self.base = torch.cuda.memory_allocated()
            self.t_gen, self.tokens, self.lengths, self.rewards = None, 0, [], []
            self.t0 = time.perf_counter()

        def generated(self, lengths, rewards):
            # Called from the reward function, right after generate returned (its ids are already host lists).
            if self.t_gen is None:
                sync()
                self.t_gen = time.perf_counter() - self.t0
            self.tokens += sum(lengths)
            self.lengths += lengths
            self.rewards += rewards

        def on_step_end(self, args, state, control, **kw):
            sync()
            dt = time.perf_counter() - self.t0
            rec = {
                "step": state.global_step,
                "time_step_s": dt,
                "time_generate_s": self.t_gen,
                "time_update_s": dt - self.t_gen if self.t_gen is not None else None,
                "sampled_tokens": self.tokens,
                "sampled_tokens_per_s": self.tokens / dt,
                "completions": len(self.lengths),
                "completion_length_mean": sum(self.lengths) / max(1, len(self.lengths)),
                "completion_length_max": max(self.lengths, default=0),
                "reward_mean": sum(self.rewards) / max(1, len(self.rewards)),
            }
            if cuda:
                mib = 1 << 20
                rec["peak_allocated_mib"] = torch.cuda.max_memory_allocated() / mib
                rec["peak_extra_mib"] = (torch.cuda.max_memory_allocated() - self.base) / mib
                rec["peak_reserved_mib"] = torch.cuda.max_memory_reserved() / mib
            self.steps.append(rec)
            self.write()
            print(
                "step %d: %.2f s (generate %.2f s), %d tokens, %.0f tokens/s%s"
                % (
                    rec["step"],
                    dt,
                    self.t_gen or float("nan"),
                    self.tokens,
                    rec["sampled_tokens_per_s"],
                    ", peak %.0f MiB" % rec["peak_allocated_mib"] if cuda else "",
                ),
                flush=True,
            )

    timer = StepTimer()

    def reward_boxed(prompts, completions, completion_ids, answer, **kw):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        rewards = [boxed_reward(t, ref) for t, ref in zip(texts, answer)]
        timer.generated([len(ids) for ids in completion_ids], rewards)
        return rewards

    out_dir = tempfile.mkdtemp(prefix="trl_grpo_peer_")
    config = GRPOConfig(
        output_dir=out_dir,
        max_steps=a.steps,
        seed=a.seed,
        use_cpu=not cuda,
        bf16=True,
        model_init_kwargs={"dtype": a.dtype},
        gradient_checkpointing=not a.no_checkpointing,
        # one RL step = one optimizer step over every completion of one generate call
        num_generations=a.samples,
        per_device_train_batch_size=a.micro_batch,
        gradient_accumulation_steps=rows_per_step // a.micro_batch,
        num_iterations=1,
        max_completion_length=a.max_new_tokens,
        temperature=a.temperature,
        top_p=1.0,
        top_k=0,
        use_vllm=False,
        use_transformers_continuous_batching=False,
        # loss
        beta=0.0,
        epsilon=a.clip_low,
        epsilon_high=a.clip_high,
        loss_type="grpo",
        scale_rewards="group",
        mask_truncated_completions=False,
        # optimizer
        learning_rate=a.lr,
        adam_beta1=a.beta1,
        adam_beta2=a.beta2,
        adam_epsilon=a.adam_eps,
        weight_decay=a.weight_decay,
        max_grad_norm=a.grad_clip,
        lr_scheduler_type="constant",
        warmup_steps=0,
        optim="adamw_torch_fused" if cuda else "adamw_torch",
        # no side work inside the timed steps
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        log_completions=False,
        dataloader_num_workers=0,
    )
    info = {
        "peer": "trl.GRPOTrainer (transformers generate)",
        "versions": {
            "trl": trl.__version__,
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "python": sys.version.split()[0],
        },
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "model": os.path.abspath(a.model),
        "settings": {k: v for k, v in vars(a).items() if k != "json"},
        "trl_args": {k: getattr(config, k) for k in TRL_ARGS},
    }
    timer.write = lambda: write_result(a.json, info, timer.steps)  # after every step: a timeout keeps them
    t_start = time.perf_counter()
    trainer = GRPOTrainer(
        model=a.model, reward_funcs=reward_boxed, args=config, train_dataset=dataset, callbacks=[timer]
    )
    info["weights_dtype"] = str(next(trainer.model.parameters()).dtype)
    info["attn_implementation"] = getattr(trainer.model.config, "_attn_implementation", None)
    info["time_setup_s"] = time.perf_counter() - t_start
    trainer.train()
    info["time_train_s"] = time.perf_counter() - t_start - info["time_setup_s"]
    info["trl_log"] = [
        {k: v for k, v in r.items() if isinstance(v, (int, float)) and math.isfinite(v)}
        for r in trainer.state.log_history
    ]
    result = write_result(a.json, info, timer.steps)
    print("steady:", json.dumps({k: round(v, 3) for k, v in result["steady"].items() if v is not None}))
    if len(timer.steps) != a.steps:
        sys.exit(f"ran {len(timer.steps)} steps, expected {a.steps}")


# The GRPOConfig fields recorded in the JSON.
TRL_ARGS = [
    "num_generations",
    "generation_batch_size",
    "steps_per_generation",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "max_completion_length",
    "temperature",
    "top_p",
    "top_k",
    "beta",
    "epsilon",
    "epsilon_high",
    "loss_type",
    "scale_rewards",
    "num_iterations",
    "learning_rate",
    "adam_beta1",
    "adam_beta2",
    "adam_epsilon",
    "weight_decay",
    "max_grad_norm",
    "lr_scheduler_type",
    "gradient_checkpointing",
    "bf16",
    "optim",
]

# The per-step figures averaged over the steady state.
STEADY_KEYS = [
    "time_step_s",
    "time_generate_s",
    "time_update_s",
    "sampled_tokens",
    "sampled_tokens_per_s",
    "completion_length_mean",
    "peak_allocated_mib",
    "peak_extra_mib",
    "peak_reserved_mib",
]


def write_result(path, info, steps):
    """info + every step so far + the steady-state means (the steps after the first, which warms up the
    kernels and the allocator), written to path; returns the dict."""
    steady = steps[1:] or steps

    def mean(key):
        vals = [s[key] for s in steady if s.get(key) is not None]
        return sum(vals) / len(vals) if vals else None

    result = dict(info, steps=steps, steady={k: mean(k) for k in STEADY_KEYS}, steady_steps=[s["step"] for s in steady])
    with open(path, "w") as f:
        json.dump(result, f, indent=1, default=str)
    return result

if __name__ == "__main__":
    main()
