"""Generation with log-probs, quantization and rollout pools (usable without the trainers)."""

from pipelines.threads import default_wait_policy

# before any submodule imports torch (and with it the OpenMP runtime): see pipelines/threads.py
default_wait_policy()
