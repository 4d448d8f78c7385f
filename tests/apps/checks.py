"""What the app checks share: failures gathered as they are found, the exit code at the end, and the
launch checks' shrunken run.

    from checks import expect, failures, finish
    expect("two steps", len(rows) == 2, log)   # a failure, with the log's tail, when not ok
    finish("critic: all checks passed")         # prints every failure and exits 1, else prints the line
"""
import sys

failures = []

# The run the launch checks (check_dist_launch.py, check_multinode.py) start under each launcher and compare
# figure for figure: configs/retool_tiny.yaml shrunk. One CPU thread a rank under every launcher, as
# OMP_NUM_THREADS=1 gives the one-process runs: under torchrun that 1 reads as torchrun's own default, and a
# rank would take its share of the host's CPUs.
LAUNCH_SMALL = ["--set", "model.init_hidden=32", "--set", "model.init_layers=2", "--set", "model.init_heads=2",
                "--set", "model.init_kv_heads=1", "--set", "model.init_intermediate=64",
                "--set", "model.tokenizer_vocab=320", "--set", "sft.steps=30", "--set", "train.prompts_per_step=4",
                "--set", "sampling.samples_per_prompt=4", "--set", "sampling.max_new_tokens=24",
                "--set", "train.eval_prompts=0", "--set", "train.checkpoint_every=2", "--set", "train.cpu_threads=1"]


def expect(what, ok, text=""):
    if not ok:
        failures.append(what + ("\n" + text[-3000:] if text else ""))


def finish(passed):
    if failures:
        print("\n\n".join("FAIL: " + f for f in failures))
        sys.exit(1)
    print(passed)
