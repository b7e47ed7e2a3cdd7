"""Text verifiers for RLVR: exact match, multiple choice, numeric with tolerance, math equivalence, format.

Every verifier reads ``completions`` (strings, or chat messages as lists of ``{"role", "content"}`` dicts) and,
except ``format``, ``ground_truths`` (one per completion: a string, a number, or a list of acceptable answers).
A completion scores 1 when correct, 0 otherwise. Model output never makes a verifier raise: a malformed
completion scores 0 and ``RewardOutput.reasons`` says why. Mismatched batch lengths are a caller error and raise.

Where the answer is read from: the last ``<answer>...</answer>`` span when there is one (the tag is
configurable), otherwise the whole completion (``require_answer_tag=True`` scores that 0 instead).
"""

from __future__ import annotations

import math
import re
import threading
import unicodedata
from collections.abc import Sequence
from typing import Any, Literal

import torch

from rewards.base import Reward, RewardOutput, StepScore
from rewards.registry import register

#: the content of a ``\boxed{...}`` (one level of nested braces, as in ``\boxed{\frac{1}{2}}``)
BOXED = re.compile(r"\\boxed\s*{([^{}]*(?:{[^{}]*}[^{}]*)*)}")

# stripped from both ends of an answer by exact_match: sentence punctuation, quotes, markdown emphasis.
# Signs, %, $ and brackets are kept: "-3" is not "3", "(B)" is handled by multiple_choice.
END_PUNCTUATION = ".,;:!?\"'`*"


def completion_text(completion: Any) -> str | None:
    """The text of a completion: a string, or the last message's content of a chat (list of dicts)."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        completion = [completion]
    if isinstance(completion, Sequence) and completion and isinstance(completion[-1], dict):
        content = completion[-1].get("content")
        if isinstance(content, list):  # multimodal message: join its text parts
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        return content if isinstance(content, str) else None
    return None


def tag_span(text: str, tag: str) -> tuple[int, str] | None:
    """``(offset, content)`` of the last ``<tag>...</tag>`` span in ``text`` (``offset``: where the content starts),
    or ``None`` when there is none."""
    spans = list(re.finditer(rf"<{re.escape(tag)}>(.*?)</{re.escape(tag)}>", text, flags=re.DOTALL))
    return (spans[-1].start(1), spans[-1].group(1)) if spans else None


def extract_tag(text: str, tag: str) -> str | None:
    """Content of the last ``<tag>...</tag>`` span in ``text``, or ``None`` when there is none."""
    found = tag_span(text, tag)
    return found[1] if found is not None else None


def normalize_answer(text: str) -> str:
    """NFKC-normalise (composed accents, "café" in one code point or two; full-width forms, "Ｐａｒｉｓ" is
    "Paris"), case-fold, collapse whitespace, strip :data:`END_PUNCTUATION` and spaces at both ends."""
    text = " ".join(unicodedata.normalize("NFKC", text).split()).casefold()
    return text.strip(END_PUNCTUATION + " ")


#: English number words and their digits, for verifiers that accept either (``ExactMatch(number_words=True)``).
NUMBER_WORDS = {
    word: str(value)
    for value, word in enumerate(
        [
            "zero",
            "one",
            "two",
            "three",
            "four",
            "five",
            "six",
            "seven",
            "eight",
            "nine",
            "ten",
            "eleven",
            "twelve",
            "thirteen",
            "fourteen",
            "fifteen",
            "sixteen",
            "seventeen",
            "eighteen",
            "nineteen",
            "twenty",
        ]
    )
}


def as_answers(ground_truth: Any) -> list[Any]:
    """A ground truth as a list of acceptable answers."""
    if isinstance(ground_truth, (list, tuple, set)):
        return list(ground_truth)
    return [ground_truth]


def check_per_completion(
    reward: str, completions: Sequence[Any], field: str, values: Sequence[Any] | None
) -> None:
    """Refuse a batch whose ``completions`` is a single string, or whose ``field`` is not one value per
    completion (``values=()``: the reward does not read ``field``); a caller error, not model output.

    Raises:
        ValueError: naming the reward, the field and the sizes.
    """
    if isinstance(completions, str):
        raise ValueError("completions must be a list (one entry per sample), got a single string")
    if isinstance(values, tuple) and not values:
        return
    if values is None or isinstance(values, str) or len(values) != len(completions):
        got = "none" if values is None else "a string" if isinstance(values, str) else str(len(values))
        raise ValueError(
            f"reward {reward!r} needs {field}, one per completion: {len(completions)} completions, got {got}"
        )


class TextVerifier(Reward):
    """Base of the verifiers: batch plumbing, answer extraction, never-raise policy.

    Subclasses implement :meth:`check` ``(answer, ground_truth) -> (score, reason)`` for one sample.
    """

    needs_ground_truth = True

    def __init__(self, answer_tag: str = "answer", require_answer_tag: bool = False):
        self.answer_tag = answer_tag
        self.require_answer_tag = require_answer_tag

    def answer(self, text: str) -> tuple[str | None, str | None]:
        """(answer text, reason when there is none)."""
        span = extract_tag(text, self.answer_tag) if self.answer_tag else None
        if span is not None:
            return span, None
        if self.require_answer_tag:
            return None, f"no <{self.answer_tag}>...</{self.answer_tag}> span"
        return text, None

    def check(self, answer: str, ground_truth: Any, from_span: bool) -> tuple[float, str | None]:
        """Score one answer; ``from_span`` tells whether it came from an answer span or is the whole text."""
        raise NotImplementedError

    def ground_truth_problem(self, ground_truth: Any) -> str | None:
        """Why this verifier cannot score against ``ground_truth`` (e.g. "is not a number"), or ``None``: lets a
        trainer reject a data file before training instead of scoring every rollout of a row 0."""
        return None

    def score(
        self, *, completions: Sequence[Any], ground_truths: Sequence[Any] | None = None, **_: Any
    ) -> RewardOutput:
        """Score each completion against its ground truth; other batch fields are ignored.

        Raises:
            ValueError: ``ground_truths`` missing or not one per completion (a caller error, not model output).
        """
        check_per_completion(
            self.name, completions, "ground_truths", ground_truths if self.needs_ground_truth else ()
        )
        truths = ground_truths if self.needs_ground_truth else [None] * len(completions)
        scores, reasons = [], []
        for completion, truth in zip(completions, truths or [], strict=True):
            value, reason = self.check_one(completion, truth)
            scores.append(value)
            reasons.append(reason)
        return RewardOutput(scores=torch.tensor(scores, dtype=torch.float32), reasons=reasons)

    def check_one(self, completion: Any, ground_truth: Any) -> tuple[float, str | None]:
        text = completion_text(completion)
        if text is None:
            return 0.0, f"completion is not text ({type(completion).__name__})"
        answer, reason = self.answer(text)
        if answer is None:
            return 0.0, reason
        try:
            # answer() returns the completion itself when there is no answer span
            return self.check(answer, ground_truth, from_span=answer is not text)
        except Exception as error:  # a verifier bug or a pathological answer must not stop training
            return 0.0, f"verifier error: {type(error).__name__}: {error}"


@register("exact_match")
class ExactMatch(TextVerifier):
    """1 if the normalised answer equals a normalised ground truth (any of several), else 0.

    Normalisation (:func:`normalize_answer`): Unicode NFKC (accents composed, full-width forms folded),
    case-folded, whitespace collapsed, ``.,;:!?"'`*`` and spaces stripped at both ends
    ("  The Red Circle. " == "the red circle"); a whole-number float ground truth reads as its integer (2.0 is
    "2"), any other as Python writes it (2.5 is "2.5").

    Args:
        answer_tag: read the answer from the last ``<answer_tag>...</answer_tag>`` span ("" to never look).
        require_answer_tag: score 0 when the span is missing instead of using the whole completion.
        number_words: read an answer that is one English number word, zero to twenty, as its digits on both
            sides ("two" == "2"), as VQA v2's evaluation does; off by default, so a task that asks for digits
            gets digits.
    """

    def __init__(
        self, answer_tag: str = "answer", require_answer_tag: bool = False, number_words: bool = False
    ):
        super().__init__(answer_tag, require_answer_tag)
        self.number_words = number_words

    def normalize(self, text: str) -> str:
        text = normalize_answer(text)
        return NUMBER_WORDS.get(text, text) if self.number_words else text

    def check(self, answer: str, ground_truth: Any, from_span: bool) -> tuple[float, str | None]:
        got = self.normalize(answer)
        if not got:
            return 0.0, "empty answer"
        if any(got == self.normalize(_truth_text(t)) for t in as_answers(ground_truth)):
            return 1.0, None
        return 0.0, f"answer {got!r} does not match"


def _truth_text(truth: Any) -> str:
    """A ground truth as text; a whole float is written as the integer it is (a table column of floats, a JSON
    ``2.0``: the answer "2" matches it)."""
    if isinstance(truth, float) and truth.is_integer():
        return str(int(truth))
    return str(truth)


# the whole answer is one option: "B", "(b)", "B.", "B)"
_ONE_LETTER = re.compile(r"\(?([A-Za-z])\)?[.:)]?", flags=re.IGNORECASE)
# a list of options: "A, C", "(A) and (C)", "A/C"
_LETTER_LIST = re.compile(r"\(?[A-Z]\)?(?:\s*(?:,|;|/|&|and)?\s*\(?[A-Z]\)?)+\.?")
# an answer that starts with an option and explains it: "B. the red one", "(B) red", and in lower case with
# parentheses or a full stop, "(b) red", "b. red" (a bare "a red one" is the article)
_LEADING_LETTER = re.compile(r"(?:\(?([A-Z])\)?[.:)]?|\(([a-z])\)|([a-z])\.)\s")
# an option letter standing alone in free text: "B", "(B)", but not the B of "Bob"
_STANDALONE = re.compile(r"(?<![A-Za-z])\(?([A-Z])\)?(?![A-Za-z])")
# "I" and "A" opening an answer bare (no parentheses, no ".", ":" or ")") before a lower-case word are English
# words, the pronoun ("I think B") and the article ("A red one, so B"), unless that word makes the letter the
# subject of the answer ("I is correct", "A is better than B", "A because ...")
_A_SUBJECT = (
    "is|was|seems|looks|matches|fits|has|shows|wins|because|since|and|or|than|would|should|could|must"
)
_LEADING_WORD = re.compile(rf"(?:I\s+(?!is\b)|A\s+(?!(?:{_A_SUBJECT})\b))[a-z]")
# a ground truth that is option letters alone, separated: "B", "(b)", "A,C", "A and C"
_TRUTH_LETTERS = re.compile(r"\(?[A-Za-z]\)?[.:]?(?:(?:\s*(?:,|;|/|&|\band\b)\s*|\s+)\(?[A-Za-z]\)?[.:]?)*")
# a ground truth that is an option with its text: "(B) red", "B) red", "B. red", "B: red"
_TRUTH_LEADING = re.compile(r"(?:\(([A-Za-z])\)|([A-Za-z])[.:)])\s")


@register("multiple_choice")
class MultipleChoice(TextVerifier):
    """1 if the chosen option letter(s) equal the ground truth letter(s), else 0.

    The choice is read from the answer span, or from the completion's last "answer is X" / "Answer: X" when
    there is no span, after Unicode NFKC normalisation (full-width ``Ｂ`` is ``B``). Accepted forms: ``B``,
    ``(B)``, ``B.``, ``B) text``, and in lower case ``b``, ``(b) text``, ``b. text``; an answer opening with
    the pronoun "I" or the article "A" reads it as that word ("I think B" chooses B); a multi-answer ground
    truth such as ``"A,C"`` or ``["A", "C"]`` needs exactly that set (``"A, C"``, ``"(A) and (C)"``). Several
    different letters for a single-answer question score 0 ("ambiguous"), so listing every option is never
    rewarded.

    Args:
        choices: the valid option letters.
        answer_tag, require_answer_tag: as in ``exact_match``.
    """

    def __init__(
        self, choices: str = "ABCDEFGHIJ", answer_tag: str = "answer", require_answer_tag: bool = False
    ):
        super().__init__(answer_tag, require_answer_tag)
        self.choices = choices.upper()

    def letters(self, answer: str, from_span: bool) -> set[str]:
        """The option letters an answer chooses (upper case)."""
        text = unicodedata.normalize("NFKC", answer).strip()  # full-width "Ｂ" is B
        match = _ONE_LETTER.fullmatch(text)
        if match:
            return {match.group(1).upper()}
        if not from_span:
            # free text: only an explicit statement counts, the letter "a" is also a word
            stated = re.findall(
                r"answer\s*(?:is|:)\s*\(?([A-Za-z])\)?(?![A-Za-z])", text, flags=re.IGNORECASE
            )
            return {stated[-1].upper()} if stated else set()
        if _LETTER_LIST.fullmatch(text):
            return set(_STANDALONE.findall(text))
        if _LEADING_WORD.match(text):  # the word is no choice: the rest of the answer names it (or nothing)
            return set(_STANDALONE.findall(text, 1))
        match = _LEADING_LETTER.match(text)
        if match:
            return {next(letter for letter in match.groups() if letter).upper()}
        # free text in the span: every letter that stands alone counts (several = ambiguous)
        return set(_STANDALONE.findall(text))

    @staticmethod
    def truth_letters(ground_truth: Any) -> set[str] | None:
        """The option letters a ground truth names (upper case), or ``None`` when a part of it names none.

        Each part (a string, or each item of a list) is option letters alone (``"B"``, ``"(b)"``, ``"A,C"``,
        ``"A and C"``, ``"ACD"``) or one option with its text, the letter in parentheses or followed by ``)``,
        ``.`` or ``:`` (``"(B) red"``, ``"B. red"``: B, not the letters of "red"; ``"red"`` alone names none).
        """
        letters: set[str] = set()
        for truth in as_answers(ground_truth):
            text = unicodedata.normalize("NFKC", str(truth)).strip()
            if re.fullmatch(r"[A-Z]+", text):  # a capital run, as multi-answer keys write "ACD"
                letters |= set(text)
            elif _TRUTH_LETTERS.fullmatch(text):
                letters |= {c.upper() for c in re.findall(r"(?<![A-Za-z])[A-Za-z](?![A-Za-z])", text)}
            elif match := _TRUTH_LEADING.match(text):
                letters.add((match.group(1) or match.group(2)).upper())
            else:
                return None
        return letters or None

    def ground_truth_problem(self, ground_truth: Any) -> str | None:
        letters = self.truth_letters(ground_truth)
        if letters is None:
            return 'names no option letter (as B, (B), A,C or "(B) red" do)'
        if not letters <= set(self.choices):
            return f"names options {sorted(letters - set(self.choices))} that are not among choices {self.choices!r}"
        return None

    def check(self, answer: str, ground_truth: Any, from_span: bool) -> tuple[float, str | None]:
        return self.compare(self.letters(answer, from_span), ground_truth)

    def compare(self, chosen: set[str], ground_truth: Any) -> tuple[float, str | None]:
        problem = self.ground_truth_problem(ground_truth)
        if problem is not None:
            raise ValueError(f"ground truth {ground_truth!r} {problem}")
        truth = self.truth_letters(ground_truth)
        invalid = chosen - set(self.choices)
        if invalid:
            return 0.0, f"choice {sorted(invalid)} is not among {self.choices!r}"
        if not chosen:
            return 0.0, "no choice found"
        if len(truth) == 1 and len(chosen) > 1:
            return 0.0, f"ambiguous: several choices {sorted(chosen)}"
        if chosen == truth:
            return 1.0, None
        return 0.0, f"chose {sorted(chosen)}"


# thousands groups of exactly three digits, with commas or spaces (plain, no-break, thin: SI's "1 000 000")
_GROUPED = r"\d{1,3}(?:,\d{3})+(?!\d)|\d{1,3}(?:[ \u00a0\u2009\u202f]\d{3})+(?!\d)"
_NUMBER = rf"[-+]?(?:{_GROUPED}|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?|[-+]?\.\d+(?:[eE][-+]?\d+)?"


_NUMBER_WORD = re.compile(r"\b(?:" + "|".join(NUMBER_WORDS) + r")\b", flags=re.IGNORECASE)

# an optional sign before the fraction negates it: "-(3/4)", and "-\frac{3}{4}" once rewritten as "-(3)/(4)"
_FRACTION = rf"([-+]?)(?:\(\s*)?({_NUMBER})(?:\s*\))?\s*/\s*(?:\(\s*)?({_NUMBER})(?:\s*\))?"
# the whole number of a mixed number, "3 1/2" (not the end of a decimal or of a grouped number)
_MIXED_WHOLE = re.compile(r"(?<![\d.,])([-+]?\d+)\s+$")
# what, before the last number, makes it part of something it does not stand for alone ...
_BEFORE = re.compile(
    r"(?:"
    r"\d[., \u00a0\u2009\u202f]?"  # glued to digits or a separator: "1,0000", "0,5", "1 0000"
    r"|[\d)]\s*[-+\u2013\u2014*/×·]\s*"  # an operator after a number: "5-10", "2024-01-05", "2 * 3", "1/2/3"
    r"|(?:\^|(?<!_)_|√)\s*"  # a power, index or root: "2^3", "x_1", "√2" ("__12__" is markdown emphasis)
    r"|\\(?:times|cdot|sqrt)\s*"
    r")$"
)
# ... and after it
_AFTER = re.compile(
    r"^(?:"
    r"[.,]?\d"  # glued digits
    r"|\s*[\^/×·√π]"  # a power, a division the fraction pattern did not read ("3/x"), a product, pi
    r"|\s*\*\s*[\d(]"  # a product ("**12**" is markdown emphasis)
    r"|\s*\\(?:times|cdot|sqrt|pi)(?![A-Za-z])"
    r")"
)


def _latex_to_plain(text: str) -> str:
    text = text.replace("\u2212", "-").replace("$", "")
    for command in (r"\,", r"\!", r"\;", r"\ ", r"\left", r"\right", r"\%", "%"):
        text = text.replace(command, " " if command == r"\ " else "")
    text = re.sub(r"\\boxed\s*{(.*)}", r"\1", text)
    text = re.sub(r"\\(?:text|textrm|mathrm|mbox)\s*{([^{}]*)}", r" \1", text)  # units: 12\text{ cm}
    text = re.sub(r"\^\s*{?\s*\\circ\s*}?", "", text)  # degrees: 90^\circ
    text = re.sub(r"(\d)\s*(\\[dt]?frac)", r"\1 \2", text)  # a mixed number, 3\frac{1}{2}, reads as 3 1/2
    text = re.sub(r"\\[dt]?frac\s*{([^{}]*)}\s*{([^{}]*)}", r"(\1)/(\2)", text)
    # 1.5 \times 10^{3} -> 1.5e3
    text = re.sub(r"\s*(?:\\times|\\cdot|x|\*)\s*10\s*\^\s*{?\s*([-+]?\d+)\s*}?", r"e\1", text)
    return text.replace("{,}", ",")


def _value(number: str) -> float:
    return float(re.sub(r"[,\s]", "", number))  # (\s: the space groups of _GROUPED)


def parse_number(text: str) -> float | None:
    """The value of the last number in ``text``: integers, decimals, thousands groups of three digits
    (``1,000``, ``1 000``, with no-break or thin spaces too), scientific notation (``1.5e3``,
    ``1.5 \\times 10^{3}``), fractions ``a/b`` and ``\\frac{a}{b}`` (a sign before a fraction negates all
    of it: ``-\\frac{1}{2}`` and ``-(1/2)`` are -0.5), mixed numbers (``3 1/2`` and ``3\\frac{1}{2}`` are
    3.5), ``\\boxed{}``; units, degrees and ``%`` are ignored (``"12 cm"`` -> 12, ``"50%"`` -> 50).

    ``None`` when there is no number, or when the last one does not stand alone, since its value is then not
    the answer's: inside a LaTeX argument left unread (``\\frac{\\sqrt{3}}{2}``, ``\\sqrt{2}``,
    ``2^{10}``), glued to other digits (``1,0000``, ``0,5``), after an operator joining it to the number
    before (a range or a difference ``5-10``, a date ``2024-01-05``, a product ``2 \\times 3``), or under a
    power, root or pi (``2^3``, ``√2``, ``2\\pi``).
    """
    plain = _latex_to_plain(text)
    numbers = list(re.finditer(_NUMBER, plain))
    if not numbers:
        return None
    start, end = numbers[-1].span()
    fractions = list(re.finditer(_FRACTION, plain))
    # the last number is a denominator: the answer is the whole fraction
    if fractions and fractions[-1].end() >= end:
        start, end = fractions[-1].span()
        sign, *parts = fractions[-1].groups()
        numerator, denominator = (_value(g) for g in parts)
        if denominator == 0:
            return None
        value = -numerator / denominator if sign == "-" else numerator / denominator
        whole = None if sign else _MIXED_WHOLE.search(plain, 0, start)
        if whole is not None:
            start = whole.start()
            value = _value(whole.group(1)) + (-value if whole.group(1).startswith("-") else value)
    else:
        value = _value(numbers[-1].group())
    # a sign opening the number belongs to what comes before when that is a number: "5-10" is no -10
    before = plain[: start + (plain[start] in "+-")]
    if before.count("{") > before.count("}") or _BEFORE.search(before) or _AFTER.match(plain[end:]):
        return None
    return value


@register("numeric")
class Numeric(TextVerifier):
    """1 if the answer's number is within tolerance of the ground truth, else 0:

        |pred - truth| <= max(rel_tol * max(|pred|, |truth|), abs_tol)     (``math.isclose``)

    The number is the last one in the answer (see :func:`parse_number`), so "so x = 12 cm" reads 12; an
    answer whose last number is part of an expression the parser does not evaluate
    (``\\frac{\\sqrt{3}}{2}``, ``5-10``) scores 0, never as the number it happens to end with.

    Args:
        rel_tol, abs_tol: tolerances (defaults: 1e-4 relative, 1e-6 absolute).
        answer_tag, require_answer_tag: as in ``exact_match``. Without a span, a ``\\boxed{}`` is used when
            present.
        number_words: read English number words, zero to twenty, as their digits ("three" -> 3, "The answer is
            three." -> 3); off by default.
    """

    def __init__(
        self,
        rel_tol: float = 1e-4,
        abs_tol: float = 1e-6,
        answer_tag: str = "answer",
        require_answer_tag: bool = False,
        number_words: bool = False,
    ):
        super().__init__(answer_tag, require_answer_tag)
        if rel_tol < 0 or abs_tol < 0:
            raise ValueError(f"tolerances must be >= 0, got rel_tol={rel_tol}, abs_tol={abs_tol}")
        self.rel_tol, self.abs_tol = rel_tol, abs_tol
        self.number_words = number_words

    def answer(self, text: str) -> tuple[str | None, str | None]:
        answer, reason = super().answer(text)
        if answer is text:
            boxed = BOXED.findall(text)
            answer = boxed[-1] if boxed else text
        return answer, reason

    def _number(self, text: str) -> float | None:
        if self.number_words:
            text = _NUMBER_WORD.sub(lambda match: NUMBER_WORDS[match.group(0).casefold()], text)
        return parse_number(text)

    def ground_truth_problem(self, ground_truth: Any) -> str | None:
        for truth in as_answers(ground_truth):
            if not isinstance(truth, (int, float)) and self._number(str(truth)) is None:
                return "is not a number"
        return None

    def check(self, answer: str, ground_truth: Any, from_span: bool) -> tuple[float, str | None]:
        value = self._number(answer)
        if value is None or not math.isfinite(value):
            return 0.0, f"no number read in answer {answer.strip()[:80]!r} (see parse_number)"
        for truth in as_answers(ground_truth):
            target = float(truth) if isinstance(truth, (int, float)) else self._number(str(truth))
            if target is None:
                raise ValueError(f"ground truth {truth!r} is not a number")
            if math.isclose(value, target, rel_tol=self.rel_tol, abs_tol=self.abs_tol):
                return 1.0, None
        return 0.0, f"{value:g} is not within tolerance of {ground_truth!r}"


@register("math_verify")
class MathVerify(TextVerifier):
    """1 if the answer is mathematically equivalent to the ground truth according to math-verify
    (Hugging Face, https://github.com/huggingface/Math-Verify), else 0.

    math-verify extracts the answer (``\\boxed{}``, the last LaTeX or plain expression), normalises units,
    percentages and malformed LaTeX, and compares symbolically with sympy: ``\\frac{1}{2}`` == ``0.5`` ==
    ``1/2``, ``\\{1, 2\\}`` == ``\\{2, 1\\}``, ``x = 2`` == ``2``.

    Args:
        timeout_s: parse/verify timeout, enforced with SIGALRM and so only in the main thread (math-verify's
            mechanism); in worker threads (the reward server) it is off.
        float_rounding: decimal places compared for floats (math-verify's default 6).
        answer_tag, require_answer_tag: as in ``exact_match``.
    """

    def __init__(
        self,
        timeout_s: int = 5,
        float_rounding: int = 6,
        answer_tag: str = "answer",
        require_answer_tag: bool = False,
    ):
        super().__init__(answer_tag, require_answer_tag)
        import math_verify  # noqa: F401  (fail at build time, not at the first score)

        self.timeout_s = timeout_s
        self.float_rounding = float_rounding

    def _timeout(self) -> int | None:
        """``timeout_s`` in the main thread; None elsewhere (SIGALRM only works there)."""
        return self.timeout_s if threading.current_thread() is threading.main_thread() else None

    def parse_math(self, text: str, bare: bool) -> list[Any]:
        """math-verify's parse of ``text`` (empty when nothing parses); ``bare``: one expression, as an answer span
        or a ground truth is."""
        from math_verify import parse

        timeout = self._timeout()
        # A bare expression: math-verify reads bare LaTeX such as "\{1, 2\}" or a list "2, 3" whole only between
        # math delimiters (unwrapped it takes the last number). Free text is parsed as is (it finds \boxed{} and
        # $...$ itself).
        if bare and "$" not in text and "\\boxed" not in text:
            parsed = parse(f"${text.strip()}$", parsing_timeout=timeout)
            if parsed:
                return parsed
        return parse(text, parsing_timeout=timeout)

    def ground_truth_problem(self, ground_truth: Any) -> str | None:
        truths = as_answers(ground_truth)
        if not truths:
            return "lists no answer"
        for truth in truths:
            if not self.parse_math(str(truth), bare=True):
                return f"does not parse as math: math-verify reads no expression in {str(truth)!r}"
        return None

    def check(self, answer: str, ground_truth: Any, from_span: bool) -> tuple[float, str | None]:
        from math_verify import verify

        predicted = self.parse_math(answer, bare=from_span)
        if not predicted:
            return 0.0, f"no parsable answer in {answer.strip()[:80]!r}"
        for truth in as_answers(ground_truth):
            gold = self.parse_math(str(truth), bare=True)
            if not gold:
                raise ValueError(f"ground truth {truth!r} does not parse")
            if verify(gold, predicted, float_rounding=self.float_rounding, timeout_seconds=self._timeout()):
                return 1.0, None
        return 0.0, f"answer {predicted[-1]!s} is not equivalent to {ground_truth!r}"


@register("format")
class Format(TextVerifier):
    """1 if the completion is ``<think>...</think><answer>...</answer>``, else 0 (DeepSeek-R1's format reward,
    arXiv 2501.12948); with ``boxed``, ``<think>...</think>`` followed by text holding a non-empty ``\\boxed{}``
    answer (EasyR1's math format).

    Whitespace around and between the blocks is allowed; each tag must occur exactly once, the answer must be
    non-empty, and no text may precede or follow the blocks unless ``allow_outside_text`` (with ``boxed``, text
    around the ``\\boxed{}`` after the think block is part of the answer).

    Args:
        think_tag, answer_tag: the tag names; ``think_tag=""`` asks for the answer block only.
        allow_outside_text: accept text before the first and after the last block.
        boxed: the answer is a ``\\boxed{}`` after the think block instead of an ``answer_tag`` block.
    """

    needs_ground_truth = False

    def __init__(
        self,
        think_tag: str = "think",
        answer_tag: str = "answer",
        allow_outside_text: bool = False,
        boxed: bool = False,
    ):
        super().__init__(answer_tag=answer_tag, require_answer_tag=False)
        if not answer_tag and not boxed:
            raise ValueError("format needs an answer_tag (or boxed=True)")
        self.think_tag = think_tag
        self.allow_outside_text = allow_outside_text
        self.boxed = boxed
        tags = (think_tag,) if boxed else (think_tag, answer_tag)
        blocks = [rf"<{re.escape(t)}>(.*?)</{re.escape(t)}>" for t in tags if t]
        edge = r".*?" if allow_outside_text else r"\s*"
        # boxed: everything after the think block is the answer text, which must hold a \boxed{}
        end = r"(.*)\Z" if boxed else edge + r"\Z"
        self.pattern = re.compile(edge + r"\s*".join(blocks) + end, flags=re.DOTALL)

    def check_one(self, completion: Any, ground_truth: Any) -> tuple[float, str | None]:
        text = completion_text(completion)
        if text is None:
            return 0.0, f"completion is not text ({type(completion).__name__})"
        for tag in (self.think_tag,) if self.boxed else (self.think_tag, self.answer_tag):
            if not tag:
                continue
            opened, closed = text.count(f"<{tag}>"), text.count(f"</{tag}>")
            if (opened, closed) != (1, 1):
                return 0.0, f"expected one <{tag}> and one </{tag}>, found {opened} and {closed}"
        match = self.pattern.match(text)
        if match is None:
            return 0.0, "blocks out of order or text outside them"
        if self.boxed:
            answers = BOXED.findall(match.groups()[-1])
            if not answers:
                return 0.0, "no \\boxed{} answer after the think block"
            if not answers[-1].strip():
                return 0.0, "empty \\boxed{}"
            return 1.0, None
        if not match.groups()[-1].strip():
            return 0.0, f"empty <{self.answer_tag}> block"
        return 1.0, None


#: a step boundary of a worked solution: a full stop followed by whitespace or the end, a semicolon, or a line break
_STEP_BOUNDARY = re.compile(r"\.(?=\s|$)|;|\n")


def solution_step_spans(text: str) -> list[tuple[int, int, str]]:
    """The steps of a worked solution with where they are: ``(start, end, step)`` with ``text[start:end]`` the
    step as written (surrounding whitespace excluded) and ``step`` its normal form: split at
    :data:`_STEP_BOUNDARY` (so ``3.5`` stays one number), case-folded, whitespace collapsed and removed around
    ``= + - * / ×``; empty steps dropped.

    ``"shapes 4. Red 2"`` -> ``[(0, 8, "shapes 4"), (10, 15, "red 2")]``.
    """
    spans = []
    start = 0
    for boundary in [*_STEP_BOUNDARY.finditer(text), None]:
        end = boundary.start() if boundary is not None else len(text)
        part = text[start:end]
        step = re.sub(r"\s*([=+\-*/×])\s*", r"\1", " ".join(part.split()).casefold())
        if step:
            lead = len(part) - len(part.lstrip())
            spans.append((start + lead, start + len(part.rstrip()), step))
        if boundary is not None:
            start = boundary.end()
    return spans


def solution_steps(text: str) -> list[str]:
    """The normal forms of :func:`solution_step_spans`: ``"shapes 4. Red 2. 4 - 2 = 2"`` ->
    ``["shapes 4", "red 2", "4-2=2"]``."""
    return [step for _, _, step in solution_step_spans(text)]


def _first_error(written: str, offset: int, step: str, unmatched: list[str]) -> list[StepScore]:
    """A wrong step split at its first error: ``[StepScore(agreeing leading words, 1), StepScore(the rest, 0)]``,
    or one 0 for the whole step when no leading word agrees with an unmatched reference step (or the written
    words do not line up with the normal form's, as ``4 - 2`` with ``4-2``). ``written`` is the step as written,
    starting at character ``offset`` of the completion; ``step`` its normal form."""
    words = step.split(" ")
    agreed = 0
    for reference in unmatched:
        shared = 0
        for mine, theirs in zip(words, reference.split(" "), strict=False):
            if mine != theirs:
                break
            shared += 1
        agreed = max(agreed, shared)
    spans = [match.span() for match in re.finditer(r"\S+", written)]
    if agreed == 0 or agreed >= len(words) or len(spans) != len(words):
        return [StepScore(offset, offset + len(written), 0.0)]
    cut = spans[agreed - 1][1]
    return [
        StepScore(offset, offset + cut, 1.0),
        StepScore(offset + spans[agreed][0], offset + len(written), 0.0),
    ]


@register("reasoning_steps")
class ReasoningSteps(Reward):
    """How well a completion's worked steps match a reference solution's: the F1 of the two step multisets,

        F1 = 2 |S_pred ∩ S_ref| / (|S_pred| + |S_ref|)        (∩ of multisets; steps by :func:`solution_steps`)

    read from the completion's ``<think>`` span (the tag is configurable) and the sample's reference solution
    (``references``, one per completion; the trainer passes each question's ``VQAExample.reference``). Recall
    pays each reference step the trace states, precision keeps a trace from listing guesses: ``"red 1. red 2"``
    against ``"red 2"`` scores 2/3. A process reward checked against the data, where ``numeric`` pays the final
    answer only: with ``shapes_math`` it pays every count the answer needs, so the trace stays faithful.

    Each stated step is also scored on its own (``RewardOutput.steps``, for process credit): 1 if it matches a
    reference step not matched by an earlier stated step (the multiset intersection of the F1, in the order
    written), else 0. With ``step_credit="first_error"`` a wrong step is split where it first departs from the
    reference: its leading words that agree with an unmatched reference step (the one sharing the most leading
    words) score 1 and the rest 0, so ``"red 1"`` against ``"red 2"`` credits ``red`` and blames ``1``, while
    ``"blue 1"`` blames both (the first error of a process, as step-level verifiers label it).

    Args:
        think_tag: the tag of the worked steps; ``""`` reads the whole completion.
        step_credit: ``"whole"`` (a step scores as one) or ``"first_error"``; the F1 is the same either way.

    A completion without the span, or with no steps in it, scores 0 with a reason; never raises on model output.
    """

    #: trainers check before the first rollout that every question has a reference solution
    needs_reference = True
    scores_steps = True

    def __init__(self, think_tag: str = "think", step_credit: Literal["whole", "first_error"] = "whole"):
        if step_credit not in ("whole", "first_error"):
            raise ValueError(f"step_credit must be 'whole' or 'first_error', got {step_credit!r}")
        self.think_tag = think_tag
        self.step_credit = step_credit

    def score(
        self, *, completions: Sequence[Any], references: Sequence[str] | None = None, **_: Any
    ) -> RewardOutput:
        """Score each completion against its reference solution, and each stated step on its own (see the class
        docstring); other batch fields are ignored.

        Raises:
            ValueError: ``references`` missing, not one per completion, or an empty one (a data error: the
                questions carry no reference solutions; set ``data.reference_column``).
        """
        check_per_completion(self.name, completions, "references", references)
        scores, reasons, steps = [], [], []
        for index, (completion, reference) in enumerate(zip(completions, references, strict=True)):
            expected = solution_steps(str(reference or ""))
            if not expected:
                raise ValueError(
                    f"reward {self.name!r}: sample {index} has no reference solution ({reference!r}); the questions "
                    "need one each (data.reference_column, or a generated source that carries them)"
                )
            value, reason, stated = self._check(completion, expected)
            scores.append(value)
            reasons.append(reason)
            steps.append(stated)
        return RewardOutput(scores=torch.tensor(scores, dtype=torch.float32), reasons=reasons, steps=steps)

    def _check(self, completion: Any, expected: list[str]) -> tuple[float, str | None, list[StepScore]]:
        text = completion_text(completion)
        if text is None:
            return 0.0, f"completion is not text ({type(completion).__name__})", []
        found = tag_span(text, self.think_tag) if self.think_tag else (0, text)
        if found is None:
            return 0.0, f"no <{self.think_tag}>...</{self.think_tag}> span", []
        offset, span = found
        stated = solution_step_spans(span)
        if not stated:
            return 0.0, "no steps in the worked solution", []
        unmatched = list(expected)
        step_scores = []
        for start, end, step in stated:
            if step in unmatched:
                unmatched.remove(step)
                step_scores.append(StepScore(offset + start, offset + end, 1.0))
            elif self.step_credit == "first_error":
                step_scores.extend(_first_error(span[start:end], offset + start, step, unmatched))
            else:
                step_scores.append(StepScore(offset + start, offset + end, 0.0))
        shared = len(expected) - len(unmatched)
        f1 = 2 * shared / (len(stated) + len(expected))
        complete = shared == len(expected) == len(stated)
        return f1, None if complete else f"{shared} of {len(expected)} reference steps", step_scores
