"""A reward for the memory runs of scripts/gpu/shard.sh (reward.kind: python): the share of the response's
characters that are ASCII letters. A random checkpoint never boxes an answer, so the math reward is -1 for
every row and the update's gradient is zero; this share differs between a group's samples, so the update
moves the weights and grad_norm reports a real gradient. It measures nothing about learning."""


def reward(prompt, response, answer):
    share = sum(ch.isascii() and ch.isalpha() for ch in response) / max(1, len(response))
    return {"score": share, "correct": False}
