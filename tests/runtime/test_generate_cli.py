"""``kvflow generate`` runs the in-process engine (greedy text as the engine's own)."""

from __future__ import annotations

import json

from kvflow.cli import main


def test_generate_prints_one_json_record_per_prompt(capsys):
    code = main(["generate", "--max-new-tokens", "8", "--json", "The capital of France is"])
    assert code == 0
    record = json.loads(capsys.readouterr().out.strip())
    assert record["text"].startswith(" Paris")
    assert record["usage"]["completion_tokens"] == len(record["output_ids"]) == 8
