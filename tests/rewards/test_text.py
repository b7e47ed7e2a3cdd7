"""Text verifiers on a table of tricky answers; malformed completions score 0 with a reason, never raise."""

from __future__ import annotations

import pytest
import torch

import rewards

# (completion, ground truth, expected score)
MATH_CASES = [
    ("<answer>\\frac{1}{2}</answer>", "0.5", 1.0),
    ("<answer>1/2</answer>", "\\frac{1}{2}", 1.0),
    ("so the result is $\\boxed{\\dfrac{3}{4}}$", "0.75", 1.0),
    ("<answer>12 cm</answer>", "12", 1.0),
    ("<answer>x = 2</answer>", "2", 1.0),
    ("<answer>\\{1, 2\\}</answer>", "\\{2,1\\}", 1.0),
    ("<answer>2, 3</answer>", "$3, 2$", 1.0),
    ("<answer>  1,000 </answer>", "1000", 1.0),
    ("<answer>\\frac{\\sqrt{2}}{2}</answer>", "$\\sqrt{2}/2$", 1.0),
    ("<answer>0.3333</answer>", "\\frac{1}{3}", 0.0),  # not equal at 6 decimals
    ("<answer>3</answer>", "4", 0.0),
    ("<answer>5</answer> wait, no: <answer>6</answer>", "6", 1.0),  # the last answer span counts
    ("", "1", 0.0),
]

NUMERIC_CASES = [
    ("<answer>12 cm</answer>", 12, 1.0),
    ("<answer>3/4</answer>", "0.75", 1.0),
    ("<answer>\\frac{3}{4}</answer>", 0.75, 1.0),
    ("<answer>1,234.5</answer>", "1234.5", 1.0),
    ("<answer>1.5 \\times 10^{3}</answer>", 1500, 1.0),
    ("<answer>−7</answer>", -7, 1.0),  # unicode minus
    ("<answer>-7</answer>", 7, 0.0),
    ("<answer>50%</answer>", 50, 1.0),
    ("<answer>3.14159</answer>", 3.1416, 1.0),  # within rel_tol 1e-4
    ("<answer>3.14</answer>", 3.1416, 0.0),
    ("I computed it: \\boxed{42}. Done in 3 steps", 42, 1.0),  # \boxed wins over later numbers
    ("<answer>x = 5</answer>", ["4", "5"], 1.0),  # several acceptable answers
    ("<answer>seven</answer>", 7, 0.0),
    ("<answer>1/0</answer>", 1, 0.0),
    ("<answer>1 000</answer>", "1000", 1.0),  # thousands groups of three with spaces
    ("<answer>3 1/2</answer>", 3.5, 1.0),  # a mixed number
    ("\\boxed{\\frac{\\sqrt{3}}{2}}", 2, 0.0),  # not the 2 it ends with
    ("<answer>pages 5-10</answer>", -10, 0.0),  # a range, no negative number
    ("<answer>1,0000</answer>", 0, 0.0),
]

EXACT_CASES = [
    ("<answer>Red</answer>", "red", 1.0),
    ("<answer>  two   red\ncircles. </answer>", "Two red circles", 1.0),
    ('<answer>"blue"</answer>', "blue", 1.0),
    ("<answer>-3</answer>", "3", 0.0),  # signs are not punctuation
    ("blue", "blue", 1.0),  # no span: the whole completion
    ("<answer>square</answer>", ["circle", "square"], 1.0),
    ("<answer>squares</answer>", "square", 0.0),
    ("<answer></answer>", "", 0.0),
    ("<answer>cafe\u0301</answer>", "caf\u00e9", 1.0),  # NFD vs NFC
    ("<answer>Ｐａｒｉｓ</answer>", "Paris", 1.0),  # full-width
]

CHOICE_CASES = [
    ("<answer>B</answer>", "B", 1.0),
    ("<answer>(b)</answer>", "B", 1.0),
    ("<answer>B. the red one</answer>", "B", 1.0),
    ("After thinking, the answer is (C).", "C", 1.0),
    ("Answer: d", "D", 1.0),
    ("<answer>A, C</answer>", "A,C", 1.0),
    ("<answer>(A) and (C)</answer>", ["A", "C"], 1.0),
    ("<answer>A, C</answer>", "A", 0.0),  # listing options for a single-answer question
    ("<answer>C</answer>", "A,C", 0.0),
    ("A cat is an animal.", "A", 0.0),  # a word, not a choice
    ("<answer>K</answer>", "B", 0.0),  # not among the choices
    ("<answer>(b) red</answer>", "B", 1.0),
    ("<answer>b. red</answer>", "B", 1.0),
    ("<answer>Ｂ</answer>", "B", 1.0),  # full-width
    ("<answer>a red one</answer>", "A", 0.0),  # the article, not a choice
]


@pytest.mark.parametrize(
    ("name", "cases"),
    [
        ("math_verify", MATH_CASES),
        ("numeric", NUMERIC_CASES),
        ("exact_match", EXACT_CASES),
        ("multiple_choice", CHOICE_CASES),
    ],
)
def test_verifier_table(name, cases) -> None:
    completions, truths, expected = zip(*cases, strict=True)
    out = rewards.build(name).score(completions=list(completions), ground_truths=list(truths))
    wrong = [
        (c, t, e, s, r)
        for c, t, e, s, r in zip(completions, truths, expected, out.scores.tolist(), out.reasons, strict=True)
        if s != e
    ]
    assert not wrong, wrong
    # every 0 says why; every 1 has nothing to say
    assert all((r is None) == (s == 1.0) for s, r in zip(out.scores.tolist(), out.reasons, strict=True))


FORMAT_CASES = [
    ("<think>count them</think><answer>3</answer>", 1.0),
    ("  <think>a\nb</think>\n\n<answer>3</answer>\n", 1.0),
    ("<answer>3</answer>", 0.0),
    ("<think>x</think>", 0.0),
    ("<answer>3</answer><think>x</think>", 0.0),
    ("Sure! <think>x</think><answer>3</answer>", 0.0),
    ("<think>x</think><answer>3</answer> hope this helps", 0.0),
    ("<think>x</think><answer>  </answer>", 0.0),
    ("<think>x</think><answer>3</answer><answer>4</answer>", 0.0),
    ("<think><think>x</think></think><answer>3</answer>", 0.0),
]


def test_format_table() -> None:
    completions, expected = zip(*FORMAT_CASES, strict=True)
    out = rewards.build("format").score(completions=list(completions))
    assert out.scores.tolist() == list(expected)
    assert [r is None for r in out.reasons] == [e == 1.0 for e in expected]


BOXED_FORMAT_CASES = [
    ("<think>3 + 4</think> The answer is \\boxed{7}.", 1.0, None),
    ("<think>x</think>\\boxed{\\frac{1}{2}}", 1.0, None),
    ("<think>x</think> first \\boxed{1}, then \\boxed{ }", 0.0, "empty \\boxed{}"),
    ("<think>x</think> The answer is 7.", 0.0, "no \\boxed{} answer after the think block"),
    ("\\boxed{7} <think>x</think>", 0.0, "blocks out of order or text outside them"),
    (
        "<think>x</think><think>y</think>\\boxed{7}",
        0.0,
        "expected one <think> and one </think>, found 2 and 2",
    ),
    ("<think>x</think><answer>7</answer>", 0.0, "no \\boxed{} answer after the think block"),
]


def test_format_boxed_is_easyr1s_math_format() -> None:
    completions, expected, reasons = zip(*BOXED_FORMAT_CASES, strict=True)
    out = rewards.build("format", boxed=True).score(completions=list(completions))
    assert out.scores.tolist() == list(expected)
    assert list(out.reasons) == list(reasons)
    # the tag form is unchanged, and an answer tag is not needed in the boxed form
    assert rewards.build("format")(completions=[completions[0]]).tolist() == [0.0]
    assert rewards.build("format", answer_tag="", boxed=True)(completions=[completions[0]]).tolist() == [1.0]
    with pytest.raises(ValueError, match="format needs an answer_tag"):
        rewards.build("format", answer_tag="")


def test_format_configurable_tags() -> None:
    loose = rewards.build("format", think_tag="reasoning", answer_tag="final", allow_outside_text=True)
    scores = loose(
        completions=[
            "ok: <reasoning>r</reasoning> <final>3</final> done",
            "<think>r</think><answer>3</answer>",
        ]
    )
    assert scores.tolist() == [1.0, 0.0]
    answer_only = rewards.build("format", think_tag="")
    assert answer_only(completions=["<answer>3</answer>", "<think>x</think><answer>3</answer>"]).tolist() == [
        1.0,
        0.0,
    ]


def test_malformed_completions_never_raise() -> None:
    malformed = [
        None,
        17,
        b"bytes",
        {"role": "assistant"},
        [],
        "<answer>",
        "\\frac{",
        "<answer>\\boxed{</answer>",
    ]
    for name in ("math_verify", "numeric", "exact_match", "multiple_choice", "format"):
        out = rewards.build(name).score(completions=malformed, ground_truths=["1"] * len(malformed))
        assert out.scores.tolist() == [0.0] * len(malformed), name
        assert all(isinstance(r, str) and r for r in out.reasons), (name, out.reasons)


def test_chat_message_completions() -> None:
    chats = [
        [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "<answer>4</answer>"}],
        [
            {
                "role": "assistant",
                "content": [{"type": "text", "text": "<answer>"}, {"type": "text", "text": "5</answer>"}],
            }
        ],
    ]
    assert rewards.build("numeric")(completions=chats, ground_truths=[4, 4]).tolist() == [1.0, 0.0]


def test_require_answer_tag_and_length_errors() -> None:
    strict = rewards.build("exact_match", require_answer_tag=True)
    out = strict.score(completions=["blue", "<answer>blue</answer>"], ground_truths=["blue", "blue"])
    assert out.scores.tolist() == [0.0, 1.0]
    assert "no <answer>" in out.reasons[0]
    # a batch the caller built wrongly is an error, not a zero
    with pytest.raises(ValueError, match="one per completion"):
        strict(completions=["a", "b"], ground_truths=["a"])
    with pytest.raises(ValueError, match="needs ground_truths"):
        strict(completions=["a"])
    with pytest.raises(ValueError, match="single string"):
        strict(completions="a", ground_truths=["a"])


def test_exact_match_reads_a_whole_float_ground_truth_as_its_integer() -> None:
    exact = rewards.build("exact_match")
    completions = ["<answer>2</answer>", "<answer>2.0</answer>", "<answer>2.5</answer>", "<answer>3</answer>"]
    truths = [2.0, 2.0, 2.5, 3]
    assert exact(completions=completions, ground_truths=truths).tolist() == [1.0, 0.0, 1.0, 1.0]


def test_exact_match_number_words_only_when_asked() -> None:
    completions = [
        "<answer>two</answer>",
        "<answer>2</answer>",
        "<answer>Three.</answer>",
        "<answer>two red</answer>",
    ]
    truths = ["2", "two", "3", "2 red"]
    assert rewards.build("exact_match")(completions=completions, ground_truths=truths).tolist() == [
        0.0,
        0.0,
        0.0,
        0.0,
    ]
    lenient = rewards.build("exact_match", number_words=True)
    # a whole-answer number word is its digits, on both sides; inside a longer answer it is left alone
    assert lenient(completions=completions, ground_truths=truths).tolist() == [1.0, 1.0, 1.0, 0.0]
    assert lenient(
        completions=["<answer>twenty</answer>", "<answer>one</answer>"], ground_truths=["20", "0"]
    ).tolist() == [1.0, 0.0]


def test_multiple_choice_reads_the_option_a_ground_truth_names() -> None:
    """Option letters alone, or a leading option with its text: "(B) red" is B, not the letters B, R, E, D."""
    from rewards.text import MultipleChoice

    read = {
        "B": ["B"],
        "(b)": ["B"],
        "A, C": ["A", "C"],
        "(A) and (C)": ["A", "C"],
        "ACD": ["A", "C", "D"],
        "(B) red": ["B"],
        "B) red": ["B"],
        "B. the red one": ["B"],
        "B: red": ["B"],
    }
    assert {t: sorted(MultipleChoice.truth_letters(t)) for t in read} == read
    assert [MultipleChoice.truth_letters(t) for t in ("red", "B red", "", [])] == [None] * 4
    reward = rewards.build("multiple_choice", choices="ABCD")
    out = reward.score(
        completions=["<answer>B</answer>", "<answer>B</answer>", "<answer>(D)</answer>"],
        ground_truths=["(B) red", "B. red", "red"],
    )
    assert out.scores.tolist() == [1.0, 1.0, 0.0]
    assert out.reasons[2] == (
        "verifier error: ValueError: ground truth 'red' names no option letter (as B, (B), A,C or \"(B) red\" do)"
    )
    assert reward.ground_truth_problem("(B) red") is None
    assert reward.ground_truth_problem("red") == 'names no option letter (as B, (B), A,C or "(B) red" do)'
    assert reward.ground_truth_problem("E") == "names options ['E'] that are not among choices 'ABCD'"


def test_a_sign_before_a_fraction_negates_the_whole_fraction() -> None:
    from rewards.text import parse_number

    texts = [
        r"-\frac{1}{2}",
        "-(3/4)",
        "\u2212\\frac{1}{2}",
        r"\boxed{-\dfrac{3}{4}}",
        "+(1/4)",
        "-(-3/4)",
        "3/4",
    ]
    assert [parse_number(t) for t in texts] == [-0.5, -0.75, -0.5, -0.75, 0.25, 0.75, 0.75]
    out = rewards.build("numeric").score(
        completions=[r"<answer>-\frac{1}{2}</answer>", r"<answer>-\frac{1}{2}</answer>"],
        ground_truths=["-1/2", "1/2"],
    )
    assert out.scores.tolist() == [1.0, 0.0]
    assert out.reasons[1] == "-0.5 is not within tolerance of '1/2'"


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("1 000", 1000.0),
        ("1\u202f000\u00a0000", 1_000_000.0),  # narrow no-break and no-break spaces
        ("1\u2009234.5 m", 1234.5),  # a thin space
        ("3 1/2", 3.5),
        ("-3 1/2", -3.5),
        ("3\\frac{1}{2}", 3.5),
        ("x = 5, y = -3", -3.0),
        ("90^\\circ", 90.0),
        ("12\\text{ cm}", 12.0),
        ("**12**", 12.0),
        # the last number does not stand alone: no value rather than a wrong one
        ("\\frac{\\sqrt{3}}{2}", None),
        ("\\sqrt{2}", None),
        ("2^{10}", None),
        ("2^3", None),
        ("2\\pi", None),
        ("2 \\times 3", None),
        ("pages 5-10", None),
        ("5 \u2013 10", None),
        ("2024-01-05", None),
        ("1,0000", None),
        ("0,5", None),
        ("1 0000", None),
        ("1/2/3", None),
    ],
)
def test_parse_number_reads_groups_and_mixed_numbers_and_nothing_it_cannot_read(text, value) -> None:
    from rewards.text import parse_number

    assert parse_number(text) == value


def test_multiple_choice_reads_a_leading_pronoun_or_article_as_a_word() -> None:
    """An answer opening with "I think" chooses the letter it names, not the option I; "A is better than B" still
    chooses A (there A is the subject, not the article)."""
    answers = {
        "I think B": "B",
        "I would pick (C)": "C",
        "A red one, so D": "D",
        "A is better than B": "A",
        "I is correct": "I",
        "B is correct": "B",
        "I. a pronoun as an option": "I",
    }
    reward = rewards.build("multiple_choice")
    out = reward.score(
        completions=[f"<answer>{a}</answer>" for a in answers], ground_truths=list(answers.values())
    )
    assert out.scores.tolist() == [1.0] * len(answers), out.reasons
    out = reward.score(completions=["<answer>I think so</answer>"], ground_truths=["I"])
    assert out.scores.tolist() == [0.0] and out.reasons == ["no choice found"]


def test_math_verify_refuses_a_ground_truth_that_does_not_parse() -> None:
    reward = rewards.build("math_verify")
    assert [reward.ground_truth_problem(t) for t in ("\\frac{1}{2}", ["2", "x = 3"])] == [None, None]
    assert reward.ground_truth_problem("\\boxed{}") == (
        "does not parse as math: math-verify reads no expression in '\\\\boxed{}'"
    )
    assert (
        reward.ground_truth_problem(["2", "$$"])
        == "does not parse as math: math-verify reads no expression in '$$'"
    )
    assert reward.ground_truth_problem([]) == "lists no answer"


def test_math_verify_in_a_worker_thread() -> None:
    """The reward server scores in a worker thread, where math-verify's SIGALRM timeout cannot be armed."""
    from concurrent.futures import ThreadPoolExecutor

    reward = rewards.build("math_verify")
    with ThreadPoolExecutor(1) as pool:
        scores = pool.submit(
            reward,
            completions=["<answer>\\frac{2}{4}</answer>", "<answer>1</answer>"],
            ground_truths=["0.5", "2"],
        ).result()
    torch.testing.assert_close(scores, torch.tensor([1.0, 0.0]))


def test_solution_steps_split_and_normalise() -> None:
    from rewards.text import solution_steps

    assert solution_steps("shapes 4. Red 2. 4 - 2 = 2.") == ["shapes 4", "red 2", "4-2=2"]
    assert solution_steps("x = 3.5; y=1.5\n x+y = 5") == ["x=3.5", "y=1.5", "x+y=5"]
    assert solution_steps(" .  ; \n") == []


def test_reasoning_steps_is_the_f1_of_the_step_multisets() -> None:
    reference = "shapes 4. red 2. 4-2=2"
    completions = [
        "<think>shapes 4. red 2. 4-2=2</think><answer>2</answer>",  # every step: 1
        "<think>red 2. 4-2=2</think><answer>2</answer>",  # 2 of 3, nothing extra: 2*2/(2+3)
        "<think>shapes 4. red 1. 4-1=3</think><answer>3</answer>",  # 1 of 3 in 3 stated: 2*1/(3+3)
        "<think>red 1. red 2. red 3. shapes 4. 4-2=2</think>",  # guesses cost precision: 2*3/(5+3)
        "<think>shapes 4. shapes 4. red 2. 4-2=2</think>",  # a repeated step counts once: 2*3/(4+3)
        "<answer>2</answer>",  # no think span
        "<think> </think><answer>2</answer>",  # no steps
        None,
    ]
    out = rewards.build("reasoning_steps").score(completions=completions, references=[reference] * 8)
    expected = [1.0, 4 / 5, 2 / 6, 6 / 8, 6 / 7, 0.0, 0.0, 0.0]
    assert out.scores.tolist() == pytest.approx(expected, abs=1e-6)
    assert out.reasons[0] is None and out.reasons[1] == "2 of 3 reference steps"
    assert "no <think>" in out.reasons[5] and "no steps" in out.reasons[6] and "not text" in out.reasons[7]
    whole = rewards.build("reasoning_steps", think_tag="")
    assert whole(completions=["red 2. 4-2=2"], references=["red 2. 4-2=2"]).tolist() == [1.0]


def test_solution_step_spans_locate_each_step() -> None:
    from rewards.text import solution_step_spans

    text = " shapes 4.  Red  2. 4 - 2 = 2.\n3.5 ; x"
    spans = solution_step_spans(text)
    assert [text[a:b] for a, b, _ in spans] == ["shapes 4", "Red  2", "4 - 2 = 2", "3.5", "x"]
    assert [step for _, _, step in spans] == ["shapes 4", "red 2", "4-2=2", "3.5", "x"]


def test_reasoning_steps_scores_each_stated_step_where_it_is_written() -> None:
    completions = [
        "<think>shapes 4. red 1. red 2. 4-2=2</think><answer>2</answer>",
        "<think>x</think> <think>shapes 4. shapes 4</think>",  # the last span is read; a repeat matches once
        "<answer>2</answer>",
    ]
    out = rewards.build("reasoning_steps").score(
        completions=completions, references=["shapes 4. red 2. 4-2=2"] * 3
    )
    stated = [
        [(text[s.start : s.end], s.score) for s in steps]
        for text, steps in zip(completions, out.steps, strict=True)
    ]
    assert stated[0] == [("shapes 4", 1.0), ("red 1", 0.0), ("red 2", 1.0), ("4-2=2", 1.0)]
    assert stated[1] == [("shapes 4", 1.0), ("shapes 4", 0.0)]
    assert stated[2] == []
    # the step scores are the F1's intersection: shared steps = sum of the step scores
    assert out.scores[0].item() == pytest.approx(2 * 3 / (4 + 3))
    assert rewards.build("reasoning_steps").scores_steps and not rewards.build("format").scores_steps


def test_reasoning_steps_first_error_credit_splits_a_wrong_step_where_it_departs() -> None:
    text = "<think>shapes 4. red 1. blue 1. 4-1=3. Red  2. red</think>"
    reference = "shapes 4. red 2. 4-2=2"
    whole = rewards.build("reasoning_steps").score(completions=[text], references=[reference])
    split = rewards.build("reasoning_steps", step_credit="first_error").score(
        completions=[text], references=[reference]
    )
    stated = [(text[s.start : s.end], s.score) for s in split.steps[0]]
    assert stated == [
        ("shapes 4", 1.0),
        ("red", 1.0),  # the asked colour, then a wrong count
        ("1", 0.0),
        ("blue 1", 0.0),  # wrong from its first word
        ("4-1=3", 0.0),  # one word: no leading part agrees
        ("Red  2", 1.0),  # matches the reference step "red 2", whatever the spacing
        ("red", 0.0),  # a leading part of a reference step is not a step
    ]
    assert [(text[s.start : s.end], s.score) for s in whole.steps[0]][1] == ("red 1", 0.0)
    assert split.scores.tolist() == whole.scores.tolist() == pytest.approx([2 * 2 / (6 + 3)])
    with pytest.raises(ValueError, match="step_credit must be"):
        rewards.build("reasoning_steps", step_credit="prefix")


def test_reasoning_steps_needs_one_reference_per_completion() -> None:
    steps = rewards.build("reasoning_steps")
    with pytest.raises(ValueError, match=r"needs references.*2 completions, got none"):
        steps.score(completions=["a", "b"], ground_truths=["1", "2"])
    with pytest.raises(ValueError, match="2 completions, got 1"):
        steps.score(completions=["a", "b"], references=["red 2"])
    with pytest.raises(ValueError, match=r"sample 1 has no reference solution.*data.reference_column"):
        steps.score(completions=["a", "b"], references=["red 2", "  "])
