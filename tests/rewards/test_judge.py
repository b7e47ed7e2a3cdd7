"""VLM-judge rewards: answer parsing by hand, then end to end with the committed tiny VLM
(checkpoints/shapes_vlm) both in process (transformers) and behind an OpenAI-compatible chat endpoint on
127.0.0.1 that this test serves with the same model: both paths must give the same numbers."""

from __future__ import annotations

import ast
import base64
import io
import json
import logging
import math
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from PIL import Image

import rewards
from mmrl.data.shapes import render_prompt
from rewards.judge import (
    JudgeAnswer,
    JudgeRequest,
    TransformersJudge,
    choice_probability,
    parse_pair_choice,
    parse_rating,
    yes_probability,
)
from rewards.remote import RemoteRewardError

VLM = Path(__file__).resolve().parents[2] / "checkpoints" / "shapes_vlm"
# the question form the tiny VLM was fine-tuned on (shapes VQA "exists" questions)
EXISTS_TEMPLATE = (
    "is there a {prompt}? Answer with a number in digits if the question asks how many, otherwise with one "
    "lower-case word. Put the answer inside <answer></answer>, for example <answer>2</answer> or "
    "<answer>yes</answer>."
)
OBJECTS = ["red circle", "blue square", "green triangle", "yellow circle"]


# ---- parsing -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "rating"),
    [
        ("7", 7.0),
        ("Score: 8", 8.0),
        ("**Rating**: 9.5/10", 9.5),
        ("I would give it 6 out of 10.", 6.0),
        ("The image has 3 cats; score is 4", 4.0),
        ("accurate 5 times, rating 8", 8.0),  # "rate" inside a word is not the rating
        ("<answer>10</answer>", 10.0),
        ("11/10, amazing", None),  # out of range
        ("0", None),
        ("no number here", None),
        ("8.", 8.0),  # a full stop after the number ends the sentence
        ("10.", 10.0),
        ("I'd give it 8.", 8.0),
        ("7.5.", 7.5),
        ("3.\n", 3.0),
        ("-1", None),  # -1, outside the 1-10 scale, not a rating of 1
        ("Score: -1", None),
        ("rating is -3", None),
    ],
)
def test_parse_rating(text: str, rating: float | None) -> None:
    assert parse_rating(text, 1, 10) == rating


def test_a_signed_rating_is_read_on_a_scale_that_holds_it() -> None:
    assert parse_rating("-3", -5, 5) == -3.0
    assert parse_rating("Score: -5.", -5, 5) == -5.0
    out = rewards.build("vlm_judge", judge=Says("I'd give it 8.")).score(
        images=[Image.new("RGB", (8, 8))], prompts=["a cat"]
    )
    assert out.scores.tolist() == [pytest.approx((8 - 1) / (10 - 1))]
    assert out.components["rating"].tolist() == [8.0]


def test_choice_probability_reads_the_answer_position() -> None:
    # position 0 ("<answer>") has "yes" only as a faint alternative and is passed over; position 1 answers
    answer = JudgeAnswer(
        text="<answer>yes</answer>",
        tokens=["<answer>", "yes"],
        top_logprobs=[
            {"<answer>": math.log(0.98), "yes": math.log(0.02)},
            {"yes": math.log(0.6), " Yes": math.log(0.1), "no": math.log(0.2), "maybe": math.log(0.1)},
        ],
    )
    assert choice_probability(answer, "yes", "no") == pytest.approx(0.7 / 0.9)
    assert yes_probability(answer) == pytest.approx(0.7 / 0.9)
    # no log-probabilities: the first yes/no word of the text
    assert yes_probability(JudgeAnswer("<answer>No.</answer> yes")) == 0.0
    assert yes_probability(JudgeAnswer("Certainly, yes")) == 1.0
    assert yes_probability(JudgeAnswer("a red square")) is None


@pytest.mark.parametrize(
    ("text", "points"),
    [
        ("A", 1.0),
        ("(B)", 0.0),
        ("<answer>A</answer>", 1.0),
        ("Image B is better.", 0.0),
        ("both", None),
        # a lower-case "a" is the article unless it is the whole answer
        ("a close call, but B is better", 0.0),
        ("a close call, but image B wins", 0.0),
        ("a tie", None),
        ("b", 0.0),
        ("(a).", 1.0),
        ("<answer>a</answer>", 1.0),
    ],
)
def test_parse_pair_choice_from_text(text: str, points: float | None) -> None:
    assert parse_pair_choice(JudgeAnswer(text), prob=False) == points


def test_pair_choice_probability_reads_the_option_letters_not_the_article() -> None:
    # "a close call, B": the first token is the article "a"; the answer position is " B" (B 0.8, A 0.2)
    answer = JudgeAnswer(
        text="a close call, B",
        tokens=["a", " close", " call", ",", " B"],
        top_logprobs=[
            {"a": math.log(0.9), "A": math.log(0.05), "B": math.log(0.05)},
            {" close": 0.0},
            {" call": 0.0},
            {",": 0.0},
            {" B": math.log(0.8), " A": math.log(0.2)},
        ],
    )
    assert parse_pair_choice(answer, prob=True) == pytest.approx(0.2)


# ---- a scripted judge: exact win rates ------------------------------------------------------------------------


class PrefersRed:
    """A judge whose answer is a rule of the images (prefers the image with more red), to test the win-rate
    bookkeeping with hand-computed values."""

    def answer(self, requests: list[JudgeRequest], logprobs: bool) -> list[JudgeAnswer]:
        def red(image: Image.Image) -> int:
            r, _, b = image.convert("RGB").getpixel((0, 0))
            return r - b

        out = []
        for request in requests:
            a, b = (red(im) for im in request.images)
            out.append(JudgeAnswer("A" if a > b else "B" if b > a else "tie"))
        return out


def test_pairwise_win_rates_by_hand() -> None:
    reward = rewards.build("vlm_judge_pairwise", judge=PrefersRed())
    colours = [(255, 0, 0), (0, 0, 255), (128, 0, 128), (128, 0, 128), (10, 10, 10)]
    images = [Image.new("RGB", (8, 8), c) for c in colours]
    prompts = ["p", "p", "p", "p", "q"]  # a group of 4 and a group of 1
    out = reward.score(images=images, prompts=prompts)
    # group p: red beats all (6/6); blue loses all (0/6); the purples beat blue, lose to red, tie each other:
    # (2 wins + 2 ties * 0.5) / 6 = 0.5; the lone q scores 0.5
    torch.testing.assert_close(out.scores, torch.tensor([1.0, 0.0, 0.5, 0.5, 0.5]))
    assert out.scores[:4].sum().item() == pytest.approx(4 / 2)  # n/2 for a group of n
    torch.testing.assert_close(out.components["comparisons"], torch.tensor([6.0, 6.0, 6.0, 6.0, 0.0]))
    torch.testing.assert_close(out.components["unreadable"], torch.tensor([0.0, 0.0, 2.0, 2.0, 0.0]))
    assert out.reasons[4] == "no other sample in its group, scored 0.5"
    # metadata groups override the prompt
    grouped = reward.score(images=images[:2], prompts=["x", "y"], metadata=[{"group": 1}, {"group": 1}])
    torch.testing.assert_close(grouped.scores, torch.tensor([1.0, 0.0]))


def test_a_remote_pairwise_judge_gets_whole_groups_in_each_request() -> None:
    """With batch_size, the client packs whole groups into each request (interleaved in the batch here): the
    server's win rates are the local ones. Chunks of consecutive samples would mix the groups: the first
    request [red p, blue q, purple p] would score red 1, blue 0.5 alone, purple 0."""
    from rewards.server import ServerConfig, ServerThread

    judge = rewards.build("vlm_judge_pairwise", judge=PrefersRed())
    red, purple, blue = (255, 0, 0), (128, 0, 128), (0, 0, 255)
    images = [Image.new("RGB", (8, 8), c) for c in (red, blue, purple, red, blue, purple)]
    prompts = ["p", "q"] * 3  # p: red, purple, blue; q: blue, red, purple
    local = judge.score(images=images, prompts=prompts)
    # in each group: red beats both (1), purple beats blue (0.5), blue loses both (0)
    torch.testing.assert_close(local.scores, torch.tensor([1.0, 0.0, 0.5, 1.0, 0.0, 0.5]))
    config = ServerConfig(reward="vlm_judge_pairwise", port=0, token="t" * 32, max_wait_ms=2.0)
    with ServerThread(judge, config) as server:
        remote = rewards.build("remote", url=server.url, token="t" * 32, retries=0, batch_size=3)
        out = remote.score(images=images, prompts=prompts)
        torch.testing.assert_close(out.scores, local.scores, rtol=0, atol=0)
        torch.testing.assert_close(out.components["comparisons"], torch.full((6,), 4.0))
        assert remote.chunks({"prompts": prompts}, 6) == [[0, 2, 4], [1, 3, 5]]
        with pytest.raises(ValueError, match=r"batch_size=2 would split a group of 3 samples \(\[0, 2, 4\]"):
            rewards.build("remote", url=server.url, token="t" * 32, retries=0, batch_size=2).score(
                images=images, prompts=prompts
            )


class Says:
    """A judge that gives the same answer to every question."""

    def __init__(self, text: str):
        self.text = text

    def answer(self, requests: list[JudgeRequest], logprobs: bool) -> list[JudgeAnswer]:
        return [JudgeAnswer(self.text) for _ in requests]


class Echo:
    """A judge that answers with the question it was asked, to see the text a template builds."""

    def answer(self, requests: list[JudgeRequest], logprobs: bool) -> list[JudgeAnswer]:
        return [JudgeAnswer(request.text) for request in requests]


def test_a_template_with_literal_braces_keeps_them() -> None:
    """Only ``{prompt}`` is substituted: a JSON example in the template is sent as written, not a KeyError."""
    template = 'Reply as JSON {"score": N}. Prompt: {prompt}. {0} {prompt}'
    image = Image.new("RGB", (4, 4))
    pointwise = rewards.build("vlm_judge", judge=Echo(), template=template).score(
        images=[image], prompts=["a {cat}"]
    )
    assert pointwise.reasons == [
        """unreadable answer, scored 0: judge answered 'Reply as JSON {"score": N}. Prompt: a {cat}. {0} a {cat}'"""
    ]
    pairwise = rewards.build("vlm_judge_pairwise", judge=Echo(), template=template).score(
        images=[image, image], prompts=["p", "p"]
    )
    assert pairwise.reasons[0] == (
        """A vs 1: 'Reply as JSON {"score": N}. Prompt: p. {0} p'; B vs 1: 'Reply as JSON {"score": N}. Prompt: p. {0} p'"""
    )


def test_bad_options_are_named() -> None:
    with pytest.raises(ValueError, match="needs base_url"):
        rewards.build("vlm_judge")
    with pytest.raises(ValueError, match=r"must contain \{prompt\}"):
        rewards.build("vlm_judge", judge=PrefersRed(), template="rate it")
    with pytest.raises(ValueError, match="mode must be"):
        rewards.build("vlm_judge", judge=PrefersRed(), mode="likert")


# ---- the real tiny VLM, in process and over HTTP ----------------------------------------------------------------


@pytest.fixture(scope="module")
def local_judge() -> TransformersJudge:
    return TransformersJudge(str(VLM), top_logprobs=20)


class ChatEndpoint:
    """A minimal OpenAI-compatible ``POST /v1/chat/completions`` on 127.0.0.1 answering with a local judge
    (greedy; ``logprobs``/``top_logprobs`` as the OpenAI format lays them out). ``fail_first`` answers 503 to
    that many requests first (to exercise retries); ``key`` is the bearer token it requires."""

    def __init__(self, judge: TransformersJudge, key: str, fail_first: int = 0):
        self.judge, self.key, self.fail_first = judge, key, fail_first
        self.requests = 0
        self.lock = threading.Lock()
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:  # quiet
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with endpoint.lock:
                    endpoint.requests += 1
                    fail = endpoint.requests <= endpoint.fail_first
                if self.headers.get("Authorization") != f"Bearer {endpoint.key}":
                    return self.reply(401, {"error": {"message": "invalid api key"}})
                if fail:
                    return self.reply(503, {"error": {"message": "warming up"}})
                if self.path != "/v1/chat/completions" or body.get("model") != "shapes-vlm":
                    return self.reply(404, {"error": {"message": f"no model {body.get('model')!r} here"}})
                images, text = [], ""
                for item in body["messages"][-1]["content"]:
                    if item["type"] == "image_url":
                        data = item["image_url"]["url"].split(",", 1)[1]
                        images.append(Image.open(io.BytesIO(base64.b64decode(data))).convert("RGB"))
                    else:
                        text += item["text"]
                with endpoint.lock:  # one forward at a time
                    answer = endpoint.judge.answer([JudgeRequest(text, images)], bool(body.get("logprobs")))[
                        0
                    ]
                choice: dict = {"index": 0, "message": {"role": "assistant", "content": answer.text}}
                if body.get("logprobs"):
                    choice["logprobs"] = {
                        "content": [
                            {
                                "token": token,
                                "logprob": top.get(token, -1e9),
                                "top_logprobs": [{"token": t, "logprob": v} for t, v in top.items()],
                            }
                            for token, top in zip(answer.tokens, answer.top_logprobs, strict=True)
                        ]
                    }
                self.reply(200, {"object": "chat.completion", "model": "shapes-vlm", "choices": [choice]})

            def reply(self, status: int, payload: dict) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base_url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def __enter__(self) -> ChatEndpoint:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def endpoint(local_judge: TransformersJudge) -> Iterator[ChatEndpoint]:
    with ChatEndpoint(local_judge, key="test-key", fail_first=1) as server:
        yield server


@pytest.fixture(scope="module")
def scenes() -> tuple[list[Image.Image], list[str]]:
    """Each object's scene asked about itself and about the next object (one true, one false question)."""
    images = [render_prompt(f"a photo of a {o}", seed=i, size=64) for i, o in enumerate(OBJECTS)]
    asked = OBJECTS + OBJECTS[1:] + OBJECTS[:1]
    return images + images, asked


def openai_options(endpoint: ChatEndpoint) -> dict:
    return {
        "backend": "openai",
        "base_url": endpoint.base_url,
        "model": "shapes-vlm",
        "api_key_env": "JUDGE_KEY",
    }


def test_pointwise_yes_prob_same_over_http_and_in_process(
    endpoint: ChatEndpoint, local_judge: TransformersJudge, scenes, monkeypatch, caplog
) -> None:
    monkeypatch.setenv("JUDGE_KEY", "test-key")
    images, asked = scenes
    options = {"mode": "yes_prob", "template": EXISTS_TEMPLATE}
    local = rewards.build("vlm_judge", judge=local_judge, **options).score(images=images, prompts=asked)
    caplog.clear()  # the local judge logs too where an earlier test's run set the rewards logger to INFO
    with caplog.at_level(logging.INFO, logger="rewards.judge"):
        remote = rewards.build("vlm_judge", **openai_options(endpoint), **options).score(
            images=images, prompts=asked
        )
    torch.testing.assert_close(remote.scores, local.scores, rtol=0, atol=1e-6)
    assert remote.reasons == local.reasons
    # the tiny VLM answers these in its <answer>yes|no</answer> form: every answer is read as a probability
    assert all("unreadable" not in r for r in remote.reasons), remote.reasons
    assert ((remote.scores > 0) & (remote.scores < 1)).all(), remote.scores
    # each raw answer is logged with its question
    logged = [r.getMessage() for r in caplog.records if r.name == "rewards.judge"]
    assert len(logged) == len(images)
    assert all("is there a" in m and "answered '<answer" in m for m in logged)


def test_pairwise_over_http_matches_in_process_and_sums_to_half_the_group(
    endpoint: ChatEndpoint, local_judge: TransformersJudge, scenes, monkeypatch
) -> None:
    monkeypatch.setenv("JUDGE_KEY", "test-key")
    images, _ = scenes
    prompts = ["a red circle"] * 4
    local = rewards.build("vlm_judge_pairwise", judge=local_judge).score(images=images[:4], prompts=prompts)
    remote = rewards.build("vlm_judge_pairwise", **openai_options(endpoint), max_concurrency=3).score(
        images=images[:4], prompts=prompts
    )
    torch.testing.assert_close(remote.scores, local.scores, rtol=0, atol=0)
    # the same 12 raw answers of the real model over both paths, each comparison listed under both its samples
    assert remote.reasons == local.reasons
    assert sum(r.count(" vs ") for r in remote.reasons) == 2 * 12
    assert remote.scores.sum().item() == pytest.approx(4 / 2)
    torch.testing.assert_close(remote.components["comparisons"], torch.full((4,), 6.0))
    # the tiny VLM was never taught to answer A or B: every comparison is unreadable and counts as a tie
    torch.testing.assert_close(remote.components["unreadable"], torch.full((4,), 6.0))


def test_pointwise_score_mode_reads_ratings_or_says_unreadable(
    local_judge: TransformersJudge, scenes
) -> None:
    images, asked = scenes
    out = rewards.build("vlm_judge", judge=local_judge).score(images=images[:4], prompts=asked[:4])
    for score, reason in zip(out.scores.tolist(), out.reasons, strict=True):
        answer = reason.split("judge answered ", 1)[1]
        rating = parse_rating(ast.literal_eval(answer), 1, 10)  # the reason quotes the answer with repr
        expected = 0.0 if rating is None else (rating - 1) / 9
        assert score == pytest.approx(expected)
        assert reason.startswith("unreadable") == (rating is None)


def test_judge_served_by_the_reward_server_from_its_config(
    local_judge: TransformersJudge, scenes, monkeypatch
) -> None:
    """The shipped server config (template in the config) serves the judge; the remote client scores the same."""
    from rewards.server import ServerThread, build_reward, load_config

    images, asked = scenes
    root = VLM.parents[1]
    monkeypatch.chdir(root)  # the config names the checkpoint relative to the repository root
    config = load_config(root / "configs" / "reward_server" / "vlm_judge_local.yaml", port=0)
    reward = build_reward(config)
    assert reward.template == EXISTS_TEMPLATE
    local = rewards.build("vlm_judge", judge=local_judge, mode="yes_prob", template=EXISTS_TEMPLATE)
    with ServerThread(reward, config) as server:
        remote = rewards.build("remote", url=server.url, retries=0).score(images=images, prompts=asked)
    expected = local.score(images=images, prompts=asked)
    # images travel as PNG (lossless for these 8-bit renders): the same numbers
    torch.testing.assert_close(remote.scores, expected.scores, rtol=0, atol=1e-6)
    assert remote.reasons == expected.reasons


def test_endpoint_errors_are_clear(endpoint: ChatEndpoint, monkeypatch) -> None:
    images = [Image.new("RGB", (64, 64), "red")]
    monkeypatch.setenv("JUDGE_KEY", "wrong")
    with pytest.raises(PermissionError, match="invalid api key"):
        rewards.build("vlm_judge", **openai_options(endpoint)).score(images=images, prompts=["x"])
    monkeypatch.setenv("JUDGE_KEY", "test-key")
    options = {**openai_options(endpoint), "model": "gpt-judge"}
    with pytest.raises(ValueError, match="rejected the request: no model 'gpt-judge' here"):
        rewards.build("vlm_judge", **options).score(images=images, prompts=["x"])
    closed = {**openai_options(endpoint), "base_url": "http://127.0.0.1:9/v1", "retries": 1, "timeout": 2}
    with pytest.raises(RemoteRewardError, match="no valid answer after 2 attempts"):
        rewards.build("vlm_judge", **closed).score(images=images, prompts=["x"])
