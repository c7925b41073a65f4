"""HiCache fixtures: documents long enough that a capped device pool must spill them."""

from __future__ import annotations

import pytest

TOPICS = ["rivers", "volcanoes", "bridges", "libraries"]


def document(topic: str) -> str:
    body = " ".join(
        f"Fact {i} about {topic}: {topic} differ in size, age and history across regions."
        for i in range(8)
    )
    return f"<|im_start|>system\nYou answer questions about {topic}.\n{body}<|im_end|>\n"


def turn(topic: str, question: str) -> str:
    return f"{document(topic)}<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def conversations() -> list[list[str]]:
    """Per round, one prompt per topic: every topic comes back after all others ran."""
    questions = ["Summarize in one line.", "Name one example."]
    return [[turn(t, q) for t in TOPICS] for q in questions]
