#!/usr/bin/env python3
"""Make tiny random Hugging Face decoder checkpoints plus reference outputs.

The C++ (LibTorch) decoder tests load each OUT_DIR/<case>/ checkpoint and compare
their forward pass / generation against OUT_DIR/<case>/reference.json.

Usage:
    python3 tests/model/make_reference.py OUT_DIR [--dtype float32|bfloat16] [--device cpu|cuda]

Floats are written with the fewest digits (<= 9 significant) that round back to the exact
float32 value when parsed as double and cast to float.

Every case is built from a fixed seed on CPU in float32 (the model's own init with
config.initializer_range = --init-std, default 0.2 instead of HF's 0.02 so attention is not
near-uniform; then every parameter, norms and biases included, gets p += 0.02 * randn_like(p)),
cast to --dtype and saved (config.json, generation_config.json, model.safetensors). The
references are computed from the checkpoint re-loaded with
AutoModelForCausalLM.from_pretrained(dir, dtype=--dtype, attn_implementation="eager") on
--device, i.e. exactly the stored weights, with RoPE inv_freq kept in float32.
Running again with the same arguments reproduces identical files.

reference.json keys:
  model_type, dtype, device, case
  ids              [24]            fixed token ids (same for all cases)
  logits           [24][256]       model(ids[None]).logits[0] (float32); gemma2 includes
                                   final_logit_softcapping
  hidden_last      [24][64]        model.model(ids[None]).last_hidden_state[0], i.e. AFTER
                                   the final norm (checked == output_hidden_states[-1])
  prompt_len       8
  greedy           [16]            new tokens of generate(ids[None,:8], greedy, 16 tokens,
                                   EOS disabled -> pure argmax, no suppression)
  greedy_logits    [16][256]       raw logits of each generate() step (KV-cache path); greedy[i] is
                                   their argmax; step i has seen prompt + greedy[:i]
  batch_ids        [2][10]         ids[:10] and ids[:6] left-padded with pad id 0
  batch_mask       [2][10]         1 = real token, 0 = pad
  batch_positions  [2][10]         (mask.cumsum(-1) - 1).clamp(min=0), passed explicitly
  batch_logits     [2][10][256]    model(batch_ids, attention_mask, position_ids).logits
                                   (padded query rows are recorded but meaningless)
  sliding_layers   list of layer indices using sliding-window attention (gemma2 only)
  sliding_window   int or null (window semantics: query q sees keys k with q-window < k <= q)
  notes            free text
"""

import argparse
import json
import os
import shutil
import struct
import sys
import time

import torch
import transformers
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

SEQ_LEN = 24
PROMPT_LEN = 8
NEW_TOKENS = 16
VOCAB = 256
PAD_ID = 0
IDS_SEED = 1234
PERTURB = 0.02
# Std of the model's own normal init (config.initializer_range). The HF default 0.02 makes attention
# almost uniform at hidden_size 64 (max prob ~0.047 vs 1/24), so RoPE / softcap / scaling bugs move
# logits by <1e-3 (attn softcap: ~5e-7). 0.2 gives peaked attention and makes those effects O(0.01-1).
DEFAULT_INIT_STD = 0.2

COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    head_dim=16,
    vocab_size=VOCAB,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
)

# transformers >= 5 takes RoPE settings as `rope_parameters` (rope_theta lives inside it);
# older versions take `rope_theta` + `rope_scaling`.
_NEW_ROPE_API = "rope_parameters" in LlamaConfig().to_dict()


def rope_kwargs(theta, scaling=None):
    if _NEW_ROPE_API:
        params = {"rope_type": "default"}
        if scaling:
            params.update(scaling)
        params["rope_theta"] = float(theta)
        return {"rope_parameters": params}
    kw = {"rope_theta": float(theta)}
    if scaling:
        kw["rope_scaling"] = dict(scaling)
    return kw


def case_specs():
    return [
        (
            "llama_tied",
            1,
            LlamaConfig,
            LlamaForCausalLM,
            dict(num_key_value_heads=2, tie_word_embeddings=True, **rope_kwargs(10000.0)),
        ),
        (
            "llama_untied_rope3",
            2,
            LlamaConfig,
            LlamaForCausalLM,
            dict(
                num_key_value_heads=1,
                tie_word_embeddings=False,
                attention_bias=False,
                **rope_kwargs(
                    500000.0,
                    {
                        "rope_type": "llama3",
                        "factor": 8.0,
                        "low_freq_factor": 1.0,
                        "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 64,
                    },
                ),
            ),
        ),
        (
            "mistral",
            3,
            MistralConfig,
            MistralForCausalLM,
            dict(num_key_value_heads=2, sliding_window=None, tie_word_embeddings=False, **rope_kwargs(10000.0)),
        ),
        (
            "qwen2",
            4,
            Qwen2Config,
            Qwen2ForCausalLM,
            dict(
                num_key_value_heads=2,
                tie_word_embeddings=True,
                use_sliding_window=False,
                **rope_kwargs(10000.0),
            ),
        ),
        (
            "qwen3",
            5,
            Qwen3Config,
            Qwen3ForCausalLM,
            dict(
                num_key_value_heads=2,
                tie_word_embeddings=False,
                use_sliding_window=False,
                **rope_kwargs(10000.0),
            ),
        ),
        (
            "gemma2",
            6,
            Gemma2Config,
            Gemma2ForCausalLM,
            dict(
                num_key_value_heads=2,
                hidden_activation="gelu_pytorch_tanh",
                query_pre_attn_scalar=16,
                attn_logit_softcapping=50.0,
                final_logit_softcapping=30.0,
                sliding_window=8,
                tie_word_embeddings=True,
                **rope_kwargs(10000.0),
            ),
        ),
    ]


_F32 = struct.Struct("<f")


def _short_f32(x):
    # x is a python float holding an exact float32 value. Return the python float with the fewest
    # significant digits that still rounds (double -> float32) back to exactly x, so JSON stays
    # small but float(json_value) cast to float32 reproduces the float32 bit pattern.
    if x != x or x in (float("inf"), float("-inf")):
        raise ValueError("non-finite value in reference output")
    for digits in range(6, 10):
        y = float("%.*g" % (digits, x))
        if _F32.unpack(_F32.pack(y))[0] == x:
            return y
    return x


def tolist_f32(t):
    def conv(v):
        return [conv(e) for e in v] if isinstance(v, list) else _short_f32(v)

    return conv(t.detach().to("cpu", torch.float32).tolist())


def sliding_info(model):
    cfg = model.config
    layer_types = getattr(cfg, "layer_types", None)
    sliding = []
    # Ground truth: what each attention module will actually use.
    for i, layer in enumerate(model.model.layers):
        sw = getattr(layer.self_attn, "sliding_window", None)
        if sw is not None:
            sliding.append(i)
    if layer_types is not None:
        from_types = [i for i, t in enumerate(layer_types) if t == "sliding_attention"]
        assert from_types == sliding, (layer_types, sliding)
    return sliding, layer_types


def build(seed, cfg_cls, model_cls, extra, init_std=DEFAULT_INIT_STD):
    """Deterministic float32 CPU model: the model's own init, then p += PERTURB * randn for every parameter."""
    torch.manual_seed(seed)
    kw = dict(COMMON)
    kw["initializer_range"] = init_std
    kw.update(extra)
    config = cfg_cls(**kw)
    config._attn_implementation = "eager"
    model = model_cls(config)
    with torch.no_grad():
        for p in model.parameters():  # tied lm_head is the same Parameter, so perturbed once
            p.add_(PERTURB * torch.randn_like(p))
    return model.eval()


def manual_greedy(model, prompt):
    """Greedy decoding by full re-forward each step (no KV cache). Returns (tokens [N], logits [N, V])."""
    seq = prompt.clone()
    steps = []
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            logits = model(input_ids=seq, use_cache=False).logits[:, -1, :]
            steps.append(logits[0])
            seq = torch.cat([seq, logits.argmax(-1, keepdim=True)], dim=1)
    return seq[0, prompt.shape[1]:], torch.stack(steps)


def run_case(out_dir, name, seed, cfg_cls, model_cls, extra, dtype, device, ids_cpu, init_std):
    model = build(seed, cfg_cls, model_cls, extra, init_std)
    notes = []

    case_dir = os.path.join(out_dir, name)
    if os.path.isdir(case_dir):
        shutil.rmtree(case_dir)
    os.makedirs(case_dir)
    model.to(dtype)  # weights stored in the requested dtype
    model.save_pretrained(case_dir, safe_serialization=True)
    del model
    # Compute every reference from the checkpoint loaded the standard way. This matters for bf16:
    # model.to(bfloat16) would also round the RoPE inv_freq buffers to bf16, whereas
    # from_pretrained(dtype=bfloat16) keeps inv_freq (and cos/sin computation) in float32.
    model = (
        AutoModelForCausalLM.from_pretrained(case_dir, dtype=dtype, attn_implementation="eager").to(device).eval()
    )
    assert model.config._attn_implementation == "eager"
    inv_freq = getattr(model.model.rotary_emb, "inv_freq", None)
    assert inv_freq is None or inv_freq.dtype == torch.float32, inv_freq.dtype
    cfg = model.config

    ids = ids_cpu.to(device)
    with torch.no_grad():
        out = model(input_ids=ids[None], output_hidden_states=True)
        logits = out.logits[0]
        base = model.model(input_ids=ids[None])
        hidden_last = base.last_hidden_state[0]
        # Convention check: last_hidden_state is after the final norm, and equals hidden_states[-1].
        assert torch.equal(out.hidden_states[-1][0], hidden_last), "hidden_states[-1] != last_hidden_state"
        assert len(out.hidden_states) == cfg.num_hidden_layers + 1
        # Capture the final norm's input/output to prove last_hidden_state is post-norm.
        captured = {}
        hook = model.model.norm.register_forward_hook(lambda mod, inp, outp: captured.update(i=inp[0], o=outp))
        model.model(input_ids=ids[None])
        hook.remove()
        is_post_norm = torch.equal(captured["o"][0], hidden_last) and not torch.equal(captured["i"][0], hidden_last)
        assert is_post_norm, "last_hidden_state is not the final norm output"
        notes.append(
            "hidden_last = model.model(ids).last_hidden_state (after final norm); "
            "equals output_hidden_states[-1] in this transformers version"
        )

        # Greedy generation: disable EOS entirely so the 16 tokens are a pure argmax loop.
        prompt = ids[None, :PROMPT_LEN]
        gen_cfg = transformers.GenerationConfig(
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
            num_beams=1,
            pad_token_id=PAD_ID,
            eos_token_id=None,
            bos_token_id=None,
            return_dict_in_generate=True,
            output_logits=True,
        )
        gen = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), generation_config=gen_cfg)
        greedy = gen.sequences[0, PROMPT_LEN:]
        assert greedy.numel() == NEW_TOKENS, greedy.shape
        # Raw (unprocessed) logits of each decode step, computed with the KV cache: [16, 256].
        greedy_logits = torch.stack([step[0] for step in gen.logits])
        assert torch.equal(greedy_logits.argmax(-1), greedy), "greedy tokens are not argmax of step logits"
        manual, manual_logits = manual_greedy(model, prompt)
        greedy_matches_manual = torch.equal(greedy, manual)
        cache_vs_nocache = (greedy_logits.float() - manual_logits.float()).abs().max().item()
        if not greedy_matches_manual:
            notes.append("WARNING: generate() (KV cache) differs from no-cache argmax loop: %s" % manual.tolist())
        cfg_eos = getattr(cfg, "eos_token_id", None)
        eos_list = cfg_eos if isinstance(cfg_eos, list) else ([] if cfg_eos is None else [cfg_eos])
        if any(t in eos_list for t in greedy.tolist()):
            notes.append("greedy contains config eos_token_id %s (generation ignores EOS)" % cfg_eos)

        # Left-padded batch.
        lens = [10, 6]
        L = max(lens)
        batch_ids = torch.full((2, L), PAD_ID, dtype=torch.long)
        batch_mask = torch.zeros((2, L), dtype=torch.long)
        for b, n in enumerate(lens):
            batch_ids[b, L - n:] = ids_cpu[:n]
            batch_mask[b, L - n:] = 1
        batch_pos = (batch_mask.cumsum(-1) - 1).clamp(min=0)
        batch_logits = model(
            input_ids=batch_ids.to(device),
            attention_mask=batch_mask.to(device),
            position_ids=batch_pos.to(device),
        ).logits
        # Consistency: unpadded rows of the batch must match the single-sequence logits.
        full_f = logits.float()
        diffs = []
        for b, n in enumerate(lens):
            diffs.append((batch_logits[b, L - n:].float() - full_f[:n]).abs().max().item())

    sliding, layer_types = sliding_info(model)
    if sliding:
        notes.append(
            "sliding layers %s use window %d: query q attends keys k with q - %d < k <= q (index in the padded "
            "sequence)" % (sliding, cfg.sliding_window, cfg.sliding_window)
        )

    biases = sorted({n.split(".")[-2] for n, _ in model.named_parameters() if n.endswith(".bias")})
    if biases:
        notes.append("linear biases present on: %s" % ",".join(biases))
    else:
        notes.append("no linear biases")
    if getattr(cfg, "tie_word_embeddings", False):
        notes.append("lm_head tied to embed_tokens (lm_head.weight not stored in safetensors)")
    if name == "gemma2":
        notes.append(
            "gemma2: embeddings scaled by sqrt(hidden) (computed in model dtype), RMSNorm weight used as (1+w), "
            "attn scale query_pre_attn_scalar**-0.5, attn and final logit softcapping applied (logits are post-softcap)"
        )
    if name == "qwen3":
        notes.append("qwen3: q_norm/k_norm RMSNorm over head_dim applied before RoPE")

    ref = {
        "case": name,
        "model_type": cfg.model_type,
        "dtype": str(dtype).replace("torch.", ""),
        "device": str(device),
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "ids": ids_cpu.tolist(),
        "logits": tolist_f32(logits),
        "hidden_last": tolist_f32(hidden_last),
        "hidden_last_is_post_norm": bool(is_post_norm),
        "prompt_len": PROMPT_LEN,
        "greedy": greedy.tolist(),
        "greedy_logits": tolist_f32(greedy_logits),
        "greedy_matches_no_cache_argmax": bool(greedy_matches_manual),
        "greedy_logits_cache_vs_nocache_max_abs_diff": cache_vs_nocache,
        "batch_ids": batch_ids.tolist(),
        "batch_mask": batch_mask.tolist(),
        "batch_positions": batch_pos.tolist(),
        "batch_logits": tolist_f32(batch_logits),
        "batch_vs_single_max_abs_diff": diffs,
        "sliding_layers": sliding,
        "sliding_window": (cfg.sliding_window if sliding else None),
        "layer_types": layer_types,
        "notes": "; ".join(notes),
    }
    with open(os.path.join(case_dir, "reference.json"), "w") as f:
        json.dump(ref, f)

    size = sum(os.path.getsize(os.path.join(case_dir, fn)) for fn in os.listdir(case_dir))
    print(
        "%-20s type=%-8s dtype=%s dir=%.0fKB logits|max|=%.4f greedy=%s batch_diff=%s gen==manual=%s sliding=%s biases=%s"
        % (
            name,
            cfg.model_type,
            ref["dtype"],
            size / 1024.0,
            logits.float().abs().max().item(),
            greedy.tolist(),
            ["%.2e" % d for d in diffs],
            greedy_matches_manual,
            sliding,
            biases or "-",
        ),
        flush=True,
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument(
        "--init-std",
        type=float,
        default=DEFAULT_INIT_STD,
        help="config.initializer_range used by the model's own init (default %(default)s; HF default is 0.02)",
    )
    args = ap.parse_args()

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            sys.exit("CUDA requested but not available")
        # Keep float32 matmuls exact-ish on GPU (no TF32).
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False

    os.makedirs(args.out_dir, exist_ok=True)
    g = torch.Generator().manual_seed(IDS_SEED)
    ids_cpu = torch.randint(1, VOCAB, (SEQ_LEN,), generator=g)

    t0 = time.time()
    for name, seed, cfg_cls, model_cls, extra in case_specs():
        run_case(args.out_dir, name, seed, cfg_cls, model_cls, extra, dtype, device, ids_cpu, args.init_std)

    with open(os.path.join(args.out_dir, "versions.json"), "w") as f:
        json.dump(
            {
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "python": sys.version.split()[0],
                "dtype": args.dtype,
                "device": args.device,
                "init_std": args.init_std,
                "perturb_std": PERTURB,
            },
            f,
            indent=2,
        )
    print("done in %.1fs -> %s" % (time.time() - t0, args.out_dir))


if __name__ == "__main__":
    main()
