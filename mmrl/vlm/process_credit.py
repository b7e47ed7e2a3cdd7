"""Process credit: token advantages from a reward's scores of the steps each completion states.

A reward with ``scores_steps`` (``reasoning_steps``) returns, per completion, the character span and score of
every step it wrote (:class:`rewards.base.StepScore`). This module finds the tokens that wrote each span and hands
the steps to :func:`mmrl.core.advantages.process_supervised`, which normalises the step scores and spreads them
over the tokens. The trainer adds the result to the sequence advantage:

    A_{i,t} = A_i + weight * sum_{j of i: last_j >= t} r~_j        (credit="return"; "step": the step's own r~_j)

so a right count written in a wrong trace is still pushed up, and a wrong one in a right trace down, where the
sequence reward alone gives every token of a completion the same sign.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from typing import Any, Literal

import torch

from mmrl.core import advantages as adv_lib
from rewards.base import StepScore

__all__ = ["process_advantages", "token_char_ends"]


#: tokens of left context each token is decoded with in :func:`token_char_ends`
DECODE_CONTEXT = 8


def token_char_ends(tokenizer: Any, token_ids: Sequence[int], context: int = DECODE_CONTEXT) -> list[int]:
    """``[T]`` the length of the decoded text after each token: token ``k`` wrote characters
    ``ends[k-1]:ends[k]`` of ``tokenizer.decode(token_ids, skip_special_tokens=True)`` (special tokens write
    none).

    Each token's share is ``len(decode(window + [token])) - len(decode(window))`` with ``window`` the ``context``
    tokens before it, so a completion costs ``O(T * context)`` decoded tokens instead of ``O(T^2)`` for decoding
    every prefix (a 1,000-token trace: thousands, not half a million). Both decodes start at the same token, so a
    tokenizer that drops a leading space at the start of a text (SentencePiece) drops it from both; a character
    split over several byte-level tokens is counted on its first token (which decodes as one replacement
    character), given ``context >= 3`` (a UTF-8 character spans at most 4 bytes). The caller checks the last end
    against the text's length."""
    ends: list[int] = []
    written = 0
    for k in range(len(token_ids)):
        window = list(token_ids[max(0, k - context) : k])
        before = len(tokenizer.decode(window, skip_special_tokens=True)) if window else 0
        after = len(tokenizer.decode([*window, token_ids[k]], skip_special_tokens=True))
        written += max(after - before, 0)
        ends.append(written)
    return ends


def process_advantages(
    tokenizer: Any,
    completions: Sequence[tuple[Sequence[int], str]],
    steps: Sequence[Sequence[StepScore]],
    group_ids: torch.Tensor | None,
    num_tokens: int,
    credit: Literal["return", "step"] = "return",
    normalize: Literal["all", "position"] = "all",
) -> tuple[torch.Tensor, dict[str, float]]:
    """``([N, num_tokens] token advantages, metrics)`` of completions scored step by step.

    Args:
        tokenizer: the tokenizer that decoded the completions.
        completions: ``(token ids, text)`` of each completion, the text as the reward read it.
        steps: per completion, its scored steps (character spans of its text).
        group_ids: ``[N]`` the prompt group of each completion (group mode: steps are normalised within a
            group), or ``None`` to normalise over all the batch's steps (single rollout).
        num_tokens: width of the result (at least the longest completion).
        credit: as :func:`mmrl.core.advantages.process_supervised`.
        normalize: ``"all"``: a step's score is normalised among all the steps of its group (DeepSeekMath);
            ``"position"``: among the steps written at the same position (the k-th step of each completion), so
            a step that is usually right (a trace's first count) is not compared with one that is usually wrong.

    A completion whose tokens do not decode to its text (a backend that post-processes its text) gets no step
    advantages; the metric ``process/unaligned_frac`` counts them. Metrics: ``process/step_score_mean`` (mean
    score of the stated steps), ``process/steps_per_sample``.
    """
    if len(completions) != len(steps):
        raise ValueError(f"{len(completions)} completions but step scores for {len(steps)}")
    if normalize not in ("all", "position"):
        raise ValueError(f"normalize must be 'all' or 'position', got {normalize!r}")
    rows, first, last, scores, groups = [], [], [], [], []
    unaligned = 0
    width = 1 + max((len(stated) for stated in steps), default=0)  # positions per group in the group key
    for row, ((token_ids, text), stated) in enumerate(zip(completions, steps, strict=True)):
        if not stated:
            continue
        ends = token_char_ends(tokenizer, token_ids)
        if not ends or ends[-1] != len(text):
            unaligned += 1
            continue
        group = int(group_ids[row]) if group_ids is not None else 0
        for position, step in enumerate(stated):
            # the first token whose text reaches past the step's start, the first whose text reaches its end
            first_token = bisect_left(ends, step.start + 1)
            last_token = bisect_left(ends, step.end)
            if last_token >= len(ends) or first_token > last_token:
                continue
            rows.append(row)
            first.append(first_token)
            last.append(last_token)
            scores.append(step.score)
            groups.append(group * width + position if normalize == "position" else group)
    advantages = adv_lib.process_supervised(
        torch.tensor(scores, dtype=torch.float32),
        torch.tensor(rows, dtype=torch.long),
        torch.tensor(first, dtype=torch.long),
        torch.tensor(last, dtype=torch.long),
        torch.tensor(groups, dtype=torch.long),
        num_rows=len(completions),
        num_tokens=num_tokens,
        credit=credit,
    )
    metrics = {
        "process/unaligned_frac": unaligned / max(len(completions), 1),
        "process/steps_per_sample": len(scores) / max(len(completions), 1),
    }
    if scores:
        metrics["process/step_score_mean"] = sum(scores) / len(scores)
    return advantages, metrics
