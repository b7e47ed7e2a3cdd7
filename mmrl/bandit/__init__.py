"""The core demo: GRPO on a synthetic contextual bandit, exercising every part of mmrl/core on a CPU in seconds.

Each prompt is a feature vector; the policy picks one of K answers; exactly one answer is correct. It is the
smallest world in which allocation, selection, advantages and losses change what is learned, and it runs the
same run infrastructure (config, run directory, checkpoints, exact resume) as the real front ends.
"""
