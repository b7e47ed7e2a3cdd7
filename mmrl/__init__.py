"""mmrl: reinforcement-learning alignment of multimodal models."""

from pipelines.threads import default_wait_policy

# before any submodule imports torch (and with it the OpenMP runtime): see pipelines/threads.py
default_wait_policy()
