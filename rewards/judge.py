"""VLM-as-judge rewards: a vision-language model rates each image (pointwise) or compares the images of a group
two by two (pairwise, Pref-GRPO style).

Pointwise, ``mode="score"``: the judge answers a rating in ``[low, high]`` (1-10 by default), read from its text
(:func:`parse_rating`) and mapped to ``(s - low) / (high - low)`` in [0, 1].
Pointwise, ``mode="yes_prob"``: the judge answers a yes/no question; the reward is
``P(yes) / (P(yes) + P(no))`` at the token where it answers, from its top log-probabilities
(:func:`yes_probability`).

Pairwise (Pref-GRPO, arXiv 2508.20751): the samples of a group (same ``metadata["group"]``, else same prompt)
are compared in every ordered pair ``(i, j)``, ``i != j`` (both orders, so the judge's preference for the first
or second image cancels out); a comparison gives 1 point to the image it prefers and 0.5 to each on a tie or
an unreadable answer (``mode="prob"``: ``P(A) / (P(A) + P(B))`` points to the first image where the judge
answers, the rest to the second). The reward of sample ``i`` is its win rate

    w_i = (points of i) / (comparisons of i) = sum_{j != i} (p_ij + 1 - p_ji) / (2 (n - 1)),

so the win rates of a group of ``n`` sum to ``n / 2``. A group of one scores 0.5.

Judges: any OpenAI-compatible chat-completions endpoint (vLLM ``serve``, SGLang, a hosted API), called with the
standard library through :func:`rewards.remote.post_json` (timeouts, retries), or a local transformers VLM.
The prompt templates are options (so they live in the run's config); each raw answer goes into the sample's
``reasons`` and the ``rewards.judge`` logger (level INFO).
"""

from __future__ import annotations

import base64
import io
import itertools
import json
import logging
import math
import os
import re
import string
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch
from PIL import Image

from rewards.base import Reward, RewardOutput
from rewards.images import ImageBatch, batch_size_of, check_prompts, images_to_pil
from rewards.registry import register
from rewards.remote import post_json

logger = logging.getLogger(__name__)

POINTWISE_SCORE_TEMPLATE = (
    "You are judging a generated image. The prompt was: {prompt}\n"
    "Rate how well the image matches the prompt and how good it looks, from 1 (worst) to 10 (best). "
    "Answer with the number only."
)
POINTWISE_YES_TEMPLATE = "Does this image show {prompt}? Answer yes or no."
PAIRWISE_TEMPLATE = (
    "Two images were generated for the prompt: {prompt}\n"
    "The first image is A, the second is B. Which one matches the prompt better? Answer A or B."
)


@dataclass
class JudgeRequest:
    """One question to the judge: ``text`` and its ``images``, shown before the text in this order."""

    text: str
    images: list[Image.Image]


@dataclass
class JudgeAnswer:
    """The judge's answer: its text and, when log-probabilities were asked for, its tokens with the top
    alternatives at each (token text -> log p, the chosen token among them)."""

    text: str
    tokens: list[str] = field(default_factory=list)
    top_logprobs: list[dict[str, float]] = field(default_factory=list)


class JudgeBackend(Protocol):
    """Answers a batch of requests, in order."""

    def answer(self, requests: Sequence[JudgeRequest], logprobs: bool) -> list[JudgeAnswer]: ...


def image_data_url(image: Image.Image) -> str:
    """``data:image/png;base64,...`` of an image, as the OpenAI chat format takes inline images."""
    buffer = io.BytesIO()
    image.convert("RGB").save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


class OpenAIChatJudge:
    """A judge behind an OpenAI-compatible ``POST {base_url}/chat/completions``.

    Each request is one chat completion (greedy, ``temperature=0``), images inline as PNG data URLs; up to
    ``max_concurrency`` requests are in flight at once. Transport failures, 408/429/5xx are retried
    (:func:`rewards.remote.post_json`).

    Args:
        base_url: the API root, e.g. ``http://127.0.0.1:8000/v1``.
        model: the model name the server serves.
        api_key_env: environment variable holding the API key (sent as a bearer token; unset: no key).
        max_tokens: most answer tokens.
        top_logprobs: alternatives asked for at the first token when log-probabilities are wanted.
        timeout, retries: seconds per attempt, retries after the first attempt.
        max_concurrency: requests in flight at once.

    Raises (from ``answer``):
        RemoteRewardError: no valid answer after every retry; ValueError: the endpoint rejected the request
        (the message names it); PermissionError: wrong or missing key.
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key_env: str = "OPENAI_API_KEY",
        max_tokens: int = 16,
        top_logprobs: int = 20,
        timeout: float = 60.0,
        retries: int = 3,
        max_concurrency: int = 8,
    ):
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must start with http:// or https://, got {base_url!r}")
        if max_tokens < 1 or max_concurrency < 1 or not 0 <= top_logprobs <= 20:
            raise ValueError(
                "need max_tokens >= 1, max_concurrency >= 1, 0 <= top_logprobs <= 20; got "
                f"{max_tokens}, {max_concurrency}, {top_logprobs}"
            )
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model = model
        self.api_key = os.environ.get(api_key_env) or None
        self.max_tokens = max_tokens
        self.top_logprobs = top_logprobs
        self.timeout = timeout
        self.retries = retries
        self.max_concurrency = max_concurrency

    def body(self, request: JudgeRequest, logprobs: bool) -> dict[str, Any]:
        """The chat-completions request body of one question."""
        content: list[dict[str, Any]] = [
            {"type": "image_url", "image_url": {"url": image_data_url(image)}} for image in request.images
        ]
        content.append({"type": "text", "text": request.text})
        body: dict[str, Any] = {
            "model": self.model,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": self.max_tokens,
            "temperature": 0.0,
        }
        if logprobs:
            body.update(logprobs=True, top_logprobs=self.top_logprobs)
        return body

    def answer(self, requests: Sequence[JudgeRequest], logprobs: bool) -> list[JudgeAnswer]:
        def one(request: JudgeRequest) -> JudgeAnswer:
            return post_json(
                self.url,
                json.dumps(self.body(request, logprobs)).encode(),
                accept=parse_chat_completion,
                token=self.api_key,
                timeout=self.timeout,
                retries=self.retries,
                label=f"judge endpoint {self.url}",
            )

        if len(requests) <= 1:
            return [one(r) for r in requests]
        with ThreadPoolExecutor(min(self.max_concurrency, len(requests))) as pool:
            return list(pool.map(one, requests))


def parse_chat_completion(data: bytes) -> JudgeAnswer | None:
    """The answer of a chat-completions response body; ``None`` when the body is not one (retried)."""
    try:
        choice = json.loads(data)["choices"][0]
        text = choice["message"]["content"]
    except (ValueError, KeyError, IndexError, TypeError, RecursionError):
        return None
    if not isinstance(text, str):
        return None
    answer = JudgeAnswer(text=text)
    for position in (choice.get("logprobs") or {}).get("content") or []:
        if not isinstance(position, dict) or not isinstance(position.get("token"), str):
            return None
        top = [(a.get("token"), a.get("logprob")) for a in position.get("top_logprobs") or []]
        answer.tokens.append(position["token"])
        answer.top_logprobs.append(
            alternatives((t, float(v)) for t, v in top if isinstance(t, str) and isinstance(v, int | float))
        )
    return answer


def alternatives(pairs: Iterable[tuple[str, float]]) -> dict[str, float]:
    """``{token text: log p}``, keeping the larger log p where two token ids decode to the same text."""
    out: dict[str, float] = {}
    for token, value in pairs:
        out[token] = max(value, out.get(token, -math.inf))
    return out


class TransformersJudge:
    """A local transformers VLM (``AutoModelForImageTextToText`` + ``AutoProcessor``) as the judge.

    Greedy generation, one request at a time, with the tokenizer's special tokens other than the stop tokens
    forbidden (a judge that emits an image token would break the chat). The top log-probabilities are those
    of that distribution (forbidden tokens have none).

    Args:
        model_path: a local directory or hub id of the VLM and its processor.
        device: torch device.
        max_tokens: most answer tokens.
        top_logprobs: alternatives kept at the first token.
    """

    def __init__(self, model_path: str, device: str = "cpu", max_tokens: int = 16, top_logprobs: int = 20):
        from transformers import AutoModelForImageTextToText, AutoProcessor

        self.processor = AutoProcessor.from_pretrained(model_path)
        self.model = AutoModelForImageTextToText.from_pretrained(model_path).to(device).eval()
        self.device = torch.device(device)
        self.max_tokens = max_tokens
        self.top_logprobs = top_logprobs
        tokenizer = self.processor.tokenizer
        eos = self.model.generation_config.eos_token_id
        self.stop_ids = [eos] if isinstance(eos, int) else list(eos or [tokenizer.eos_token_id])
        self.suppressed_ids = sorted(set(tokenizer.all_special_ids) - set(self.stop_ids))

    @torch.no_grad()
    def answer(self, requests: Sequence[JudgeRequest], logprobs: bool) -> list[JudgeAnswer]:
        answers = []
        tokenizer = self.processor.tokenizer
        for request in requests:
            content = [{"type": "image"} for _ in request.images] + [{"type": "text", "text": request.text}]
            messages = [{"role": "user", "content": content}]
            text = self.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            inputs = self.processor(text=[text], images=request.images or None, return_tensors="pt")
            inputs = {k: v.to(self.device) for k, v in inputs.items() if isinstance(v, torch.Tensor)}
            out = self.model.generate(
                **inputs,
                do_sample=False,
                temperature=None,
                top_p=None,
                top_k=None,
                max_new_tokens=self.max_tokens,
                suppress_tokens=self.suppressed_ids or None,
                eos_token_id=self.stop_ids,
                pad_token_id=self.stop_ids[0],
                output_scores=True,
                return_dict_in_generate=True,
            )
            new = out.sequences[0, inputs["input_ids"].shape[1] :].tolist()
            new = new[: next((i for i, t in enumerate(new) if t in self.stop_ids), len(new))]
            answer = JudgeAnswer(text=tokenizer.decode(new, skip_special_tokens=True))
            if logprobs:
                for token_id, step_scores in zip(new, out.scores, strict=False):
                    step = torch.log_softmax(step_scores[0].float(), dim=-1)  # [V]
                    values, ids = step.topk(min(self.top_logprobs, step.shape[0]))
                    answer.tokens.append(tokenizer.decode([token_id]))
                    answer.top_logprobs.append(
                        alternatives(
                            (tokenizer.decode([i]), v)
                            for v, i in zip(values.tolist(), ids.tolist(), strict=True)
                            if math.isfinite(v)
                        )
                    )
            answers.append(answer)
        return answers


def build_judge(
    backend: Literal["openai", "transformers"],
    base_url: str | None,
    model: str | None,
    api_key_env: str,
    model_path: str | None,
    device: str,
    max_tokens: int,
    timeout: float,
    retries: int,
    max_concurrency: int,
) -> JudgeBackend:
    """The judge the reward options name.

    Raises:
        ValueError: an unknown backend, or the options it needs are missing.
    """
    if backend == "openai":
        if not base_url or not model:
            raise ValueError("backend='openai' needs base_url (e.g. http://host:8000/v1) and model")
        return OpenAIChatJudge(
            base_url,
            model,
            api_key_env=api_key_env,
            max_tokens=max_tokens,
            timeout=timeout,
            retries=retries,
            max_concurrency=max_concurrency,
        )
    if backend == "transformers":
        if not model_path:
            raise ValueError("backend='transformers' needs model_path (a local VLM directory or hub id)")
        return TransformersJudge(model_path, device=device, max_tokens=max_tokens)
    raise ValueError(f"backend must be 'openai' or 'transformers', got {backend!r}")


# ---- reading answers ------------------------------------------------------------------------------------------

# a number with its sign, so that "-1" reads as -1, out of a 1-10 scale, not as 1
_NUMBER = r"([-+]?\d+(?:\.\d+)?)"
_RATING_PATTERNS = (
    # "Score: 7", "rating is -1" (the separator is no sign: [^\w+-] where \W would eat the minus)
    re.compile(rf"\b(?:score|rating|rate)[^\w+-]{{0,3}}(?:is[^\w+-]{{0,2}})?{_NUMBER}", re.IGNORECASE),
    re.compile(rf"{_NUMBER}\s*(?:/|out of)\s*\d+", re.IGNORECASE),  # "7/10", "7 out of 10"
    # any number; a full stop after it ends the sentence ("I'd give it 8.") unless a digit follows (8.5)
    re.compile(rf"(?<![\d.]){_NUMBER}(?!\d|\.\d)"),
)


def parse_rating(text: str, low: float, high: float) -> float | None:
    """The rating in ``text``: the number after "score"/"rating", else the ``x`` of "x/10" or "x out of 10",
    else the first number ("8", "8.", "7.5"); ``None`` when there is none or it is outside the scale
    ``[low, high]``. The sign is read with the number, so "-1" is -1: outside a 1-10 scale, not a rating
    of 1."""
    for pattern in _RATING_PATTERNS:
        match = pattern.search(text)
        if match is not None:
            value = float(match.group(1))
            return value if low <= value <= high else None
    return None


def _word(token: str, keep_case: bool = False) -> str:
    """A token or answer reduced to its letters and digits, lower-cased unless ``keep_case``
    ("<answer>Yes." -> "answeryes")."""
    return "".join(
        c for c in (token if keep_case else token.lower()) if c not in string.punctuation and not c.isspace()
    )


def choice_probability(answer: JudgeAnswer, first: str, second: str, keep_case: bool = False) -> float | None:
    """``P(first) / (P(first) + P(second))`` at the answer's first token that reads as either word, summing
    the alternatives there that read as each (punctuation ignored, and case unless ``keep_case``: "Yes",
    " yes", ">yes" all count as yes; with ``keep_case`` the option letters "A" / "B" count, not the article
    "a"). Tokens before it (``<answer>``, ``**``, "Answer:") are passed over; ``None`` when no token of the
    answer reads as either word (or there are no log-probabilities)."""
    for token, top in zip(answer.tokens, answer.top_logprobs, strict=True):
        if _word(token, keep_case) in (first, second):
            p_first = sum(math.exp(v) for t, v in top.items() if _word(t, keep_case) == first)
            p_second = sum(math.exp(v) for t, v in top.items() if _word(t, keep_case) == second)
            if p_first + p_second > 0.0:
                return p_first / (p_first + p_second)
    return None


def yes_probability(answer: JudgeAnswer) -> float | None:
    """``P(yes) / (P(yes) + P(no))`` where the judge answers (:func:`choice_probability`), else 1 or 0 from
    the first word "yes" or "no" of the text; ``None`` when neither tells."""
    probability = choice_probability(answer, "yes", "no")
    if probability is not None:
        return probability
    match = re.search(r"\b(yes|no)\b", answer.text, re.IGNORECASE)
    return None if match is None else float(match.group(1).lower() == "yes")


# The letters are matched in capitals only (the keywords in any case): a lower-case "a" opening a sentence is the
# article ("a close call, but B is better"). A lower-case letter counts only as the whole answer ("b", "(a).").
_PAIR_PATTERNS = (
    re.compile(r"^\W*(?:(?i:answer)\W*)?\(?([ABab])\)?\W*(?:(?i:answer)\W*)?$"),  # "b", "<answer>a</answer>"
    re.compile(r"^\W*(?:(?i:answer)\W*)?\(?([AB])\b"),  # "A", "(B)", "<answer>A"
    re.compile(r"\b(?i:image|answer|choice|option)\W{0,3}\(?([AB])\b"),  # "Image B is better"
)
# last resort: the one option letter an answer names ("a close call, but B is better"); both named: no choice
_PAIR_LETTER = re.compile(r"\b([AB])\b")


def parse_pair_choice(answer: JudgeAnswer, prob: bool) -> float | None:
    """Points of the first image (A) in one comparison, in [0, 1]: ``P(A) / (P(A) + P(B))`` from the first
    token when ``prob`` and either is among the top tokens; otherwise 1 (A) or 0 (B) from the text (the letter
    it opens with or names as "image B", "option A", else the only one of the two it names); ``None`` when none
    of these tells (a tie, or an answer naming both letters only in passing)."""
    if prob:
        probability = choice_probability(answer, "A", "B", keep_case=True)
        if probability is not None:
            return probability
    for pattern in _PAIR_PATTERNS:
        match = pattern.search(answer.text)
        if match is not None:
            return float(match.group(1).upper() == "A")
    named = set(_PAIR_LETTER.findall(answer.text))
    return float(named == {"A"}) if len(named) == 1 else None


# ---- the rewards ----------------------------------------------------------------------------------------------


class _JudgeReward(Reward):
    """Options shared by the judge rewards (see :class:`VLMJudge`)."""

    def __init__(
        self,
        template: str,
        backend: Literal["openai", "transformers"] = "openai",
        base_url: str | None = None,
        model: str | None = None,
        api_key_env: str = "OPENAI_API_KEY",
        model_path: str | None = None,
        device: str = "cpu",
        max_tokens: int = 16,
        timeout: float = 60.0,
        retries: int = 3,
        max_concurrency: int = 8,
        judge: JudgeBackend | None = None,
    ):
        if "{prompt}" not in template:
            raise ValueError(
                f"template must contain {{prompt}} (where the sample's prompt goes): {template!r}"
            )
        self.template = template
        self.judge = judge or build_judge(
            backend,
            base_url,
            model,
            api_key_env,
            model_path,
            device,
            max_tokens,
            timeout,
            retries,
            max_concurrency,
        )

    def question(self, prompt: str) -> str:
        """The template with ``prompt`` in place of every ``{prompt}``: a plain substitution, not
        ``str.format``, so other braces in the template (``Reply as JSON {"score": N}``) stay as written."""
        return self.template.replace("{prompt}", prompt)

    def ask(self, requests: list[JudgeRequest], logprobs: bool) -> list[JudgeAnswer]:
        answers = self.judge.answer(requests, logprobs)
        for request, answer in zip(requests, answers, strict=True):
            logger.info("judge %s asked %r answered %r", self.name, request.text, answer.text)
        return answers


@register("vlm_judge")
class VLMJudge(_JudgeReward):
    """Pointwise VLM judge: each image is rated alone (see the module docstring for the two modes).

    Unreadable answers (no rating in range; neither yes nor no) score 0, and their reason says so. Components:
    ``rating``, the rating read (``low`` where unreadable) or ``P(yes)`` (0 where unreadable). Reasons: the
    judge's raw answer of every sample.

    Args:
        mode: ``"score"`` (a rating read from the text) or ``"yes_prob"`` (yes/no probability).
        template: the question, with ``{prompt}`` where the sample's prompt goes (defaults:
            :data:`POINTWISE_SCORE_TEMPLATE`, :data:`POINTWISE_YES_TEMPLATE`).
        low, high: the rating scale of ``mode="score"``.
        backend: ``"openai"`` (``base_url``, ``model``, key from ``api_key_env``, ``timeout``, ``retries``,
            ``max_concurrency``) or ``"transformers"`` (``model_path``, ``device``).
        max_tokens: most answer tokens.
        judge: an already built judge (any :class:`JudgeBackend`), instead of the backend options.
    """

    def __init__(
        self,
        mode: Literal["score", "yes_prob"] = "score",
        template: str | None = None,
        low: float = 1.0,
        high: float = 10.0,
        **options: Any,
    ):
        if mode not in ("score", "yes_prob"):
            raise ValueError(f"mode must be 'score' or 'yes_prob', got {mode!r}")
        if not low < high:
            raise ValueError(f"need low < high, got {low}, {high}")
        default = POINTWISE_SCORE_TEMPLATE if mode == "score" else POINTWISE_YES_TEMPLATE
        super().__init__(template if template is not None else default, **options)
        self.mode = mode
        self.low, self.high = low, high

    def score(self, *, images: ImageBatch, prompts: Sequence[str] | None = None, **_: Any) -> RewardOutput:
        prompt_list = check_prompts(prompts, batch_size_of(images), self.name)
        pil = images_to_pil(images)
        requests = [JudgeRequest(self.question(p), [im]) for im, p in zip(pil, prompt_list, strict=True)]
        answers = self.ask(requests, logprobs=self.mode == "yes_prob")
        scores, ratings, reasons = [], [], []
        for answer in answers:
            if self.mode == "score":
                rating = parse_rating(answer.text, self.low, self.high)
                value = None if rating is None else (rating - self.low) / (self.high - self.low)
            else:
                rating = value = yes_probability(answer)
            unreadable = "unreadable answer, scored 0: " if value is None else ""
            scores.append(0.0 if value is None else value)
            ratings.append((self.low if self.mode == "score" else 0.0) if rating is None else rating)
            reasons.append(f"{unreadable}judge answered {answer.text!r}")
        return RewardOutput(
            scores=torch.tensor(scores, dtype=torch.float32),
            components={"rating": torch.tensor(ratings, dtype=torch.float32)},
            reasons=reasons,
        )


@register("vlm_judge_pairwise")
class PairwiseVLMJudge(_JudgeReward):
    """Pairwise VLM judge: each sample's win rate against the other samples of its group (module docstring).

    Groups are the samples sharing ``metadata[i]["group"]``, or else the same prompt. A group of ``n`` costs
    ``n (n - 1)`` judge calls with ``both_orders`` (``n (n - 1) / 2`` without, each pair shown once in batch
    order). Components: ``comparisons`` (judge calls the sample took part in) and ``unreadable`` (how many of
    them gave no choice, each counted as a tie). Reasons: the raw answers of the sample's comparisons.

    Args:
        template: the question, with ``{prompt}`` (default :data:`PAIRWISE_TEMPLATE`); the two images come
            first, in the order A, B.
        mode: ``"text"`` (the letter the judge answers) or ``"prob"`` (``P(A) / (P(A) + P(B))`` where the
            judge answers, :func:`choice_probability`; the letter of the text where that is not available).
        both_orders: ask each pair in both orders (cancels the judge's position bias).
        Other options: as :class:`VLMJudge`.
    """

    # win rates within a group: the reward server must not merge groups of different requests
    batch_dependent = True

    def __init__(
        self,
        template: str = PAIRWISE_TEMPLATE,
        mode: Literal["text", "prob"] = "text",
        both_orders: bool = True,
        **options: Any,
    ):
        if mode not in ("text", "prob"):
            raise ValueError(f"mode must be 'text' or 'prob', got {mode!r}")
        super().__init__(template, **options)
        self.mode = mode
        self.both_orders = both_orders

    def score(
        self,
        *,
        images: ImageBatch,
        prompts: Sequence[str] | None = None,
        metadata: Sequence[dict[str, Any]] | None = None,
        **_: Any,
    ) -> RewardOutput:
        size = batch_size_of(images)
        prompt_list = check_prompts(prompts, size, self.name)
        if metadata is not None and len(metadata) != size:
            raise ValueError(f"reward {self.name!r} needs one metadata dict per image ({size} images)")
        pil = images_to_pil(images)
        # 1. groups: same metadata "group", else same prompt
        groups: dict[Any, list[int]] = {}
        for i, prompt in enumerate(prompt_list):
            meta = metadata[i] if metadata is not None else None
            key = ("group", meta["group"]) if meta and meta.get("group") is not None else ("prompt", prompt)
            groups.setdefault(key, []).append(i)
        # 2. one request per ordered pair (first image = A)
        pairs = [
            pair
            for members in groups.values()
            for pair in (
                itertools.permutations(members, 2) if self.both_orders else itertools.combinations(members, 2)
            )
        ]
        requests = [JudgeRequest(self.question(prompt_list[a]), [pil[a], pil[b]]) for a, b in pairs]
        answers = self.ask(requests, logprobs=self.mode == "prob")
        # 3. points: p to A, 1 - p to B (0.5 each when unreadable)
        points = [0.0] * size
        counts = [0] * size
        unreadable = [0] * size
        said: list[list[str]] = [[] for _ in range(size)]
        for (a, b), answer in zip(pairs, answers, strict=True):
            p = parse_pair_choice(answer, prob=self.mode == "prob")
            for i in (a, b):
                counts[i] += 1
                unreadable[i] += p is None
                said[i].append(f"{'A' if i == a else 'B'} vs {b if i == a else a}: {answer.text!r}")
            p = 0.5 if p is None else p
            points[a] += p
            points[b] += 1.0 - p
        scores = [pt / c if c else 0.5 for pt, c in zip(points, counts, strict=True)]
        reasons: list[str | None] = [
            "; ".join(s) if s else "no other sample in its group, scored 0.5" for s in said
        ]
        return RewardOutput(
            scores=torch.tensor(scores, dtype=torch.float32),
            components={
                "comparisons": torch.tensor(counts, dtype=torch.float32),
                "unreadable": torch.tensor(unreadable, dtype=torch.float32),
            },
            reasons=reasons,
        )
