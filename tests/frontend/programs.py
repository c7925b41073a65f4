"""SGLang frontend programs, run unchanged against a kvflow server by the sglang venv's python:
``python programs.py <server url> <program>`` prints the program's results as JSON."""

from __future__ import annotations

import json
import sys

import sglang as sgl
from programs_schema import CITIES, CITY_QUESTION, SCHEMA, SHARED
from sglang.lang.backend.runtime_endpoint import RuntimeEndpoint


@sgl.function
def qa(s, question):
    s += sgl.system("You are a helpful assistant.")
    s += sgl.user(question)
    s += sgl.assistant(sgl.gen("answer", max_tokens=16, temperature=0))


@sgl.function
def constrained(s):
    s += "The year the Eiffel Tower was built: "
    s += sgl.gen("year", regex=r"1[0-9]{3}", max_tokens=8, temperature=0)
    s += "\nA number between 1 and 9: "
    s += sgl.gen_int("digit", max_tokens=4)
    s += "\nA city as JSON: "
    s += sgl.gen("city", json_schema=json.dumps(SCHEMA), max_tokens=40, temperature=0)


@sgl.function
def fork_join(s):
    s += SHARED
    forks = s.fork(2)
    for i, branch in enumerate(forks):
        branch += f"Fact number {i + 1}:"
        branch += sgl.gen("fact", max_tokens=8, temperature=0, stop="\n")
    forks.join()
    s += "First:" + forks[0]["fact"] + "\nSecond:" + forks[1]["fact"] + "\nIn short,"
    s += sgl.gen("summary", max_tokens=8, temperature=0)
    s["metas"] = json.dumps([f.get_meta_info("fact") for f in forks])


@sgl.function
def choose(s):
    s += CITY_QUESTION
    s += sgl.select("city", choices=CITIES)
    s += "\nQ: Is the sky green?\nA:"
    s += sgl.select("answer", choices=[" Yes", " No"])


def run(program: str) -> dict:
    if program == "qa":
        state = qa.run(question="What is the capital of France?")
        batch = qa.run_batch([{"question": "Name a color."}, {"question": "Name a fruit."}])
        streamed = qa.run(question="What is the capital of France?", stream=True)
        pieces = list(streamed.text_iter("answer"))
        return {
            "answer": state["answer"],
            "text": state.text(),
            "messages": state.messages(),
            "batch": [b["answer"] for b in batch],
            "streamed": "".join(pieces),
            "meta": state.get_meta_info("answer"),
        }
    if program == "constrained":
        state = constrained.run()
        return {"year": state["year"], "digit": state["digit"], "city": state["city"]}
    if program == "fork_join":
        state = fork_join.run()
        return {
            "facts": [json.loads(state["metas"])],
            "text": state.text(),
            "summary": state["summary"],
        }
    if program == "select":
        state = choose.run()
        return {
            "text": state.text(),
            "city": state["city"],
            "answer": state["answer"],
            "city_meta": state.get_meta_info("city"),
            "answer_meta": state.get_meta_info("answer"),
        }
    raise SystemExit(f"unknown program {program!r}")


if __name__ == "__main__":
    url, name = sys.argv[1], sys.argv[2]
    sgl.set_default_backend(RuntimeEndpoint(url, chat_template_name="chatml"))
    print(json.dumps(run(name)))
