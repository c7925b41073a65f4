"""``kvflow generate``: generate offline with the in-process :class:`~kvflow.runtime.Engine`."""

from __future__ import annotations

import argparse
import json
import sys

__all__ = ["generate_main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvflow generate",
        description="Generate for each prompt with the in-process engine (no server).",
    )
    parser.add_argument("prompts", nargs="+", help="prompt texts (raw, no chat template)")
    parser.add_argument("--model-path", default=None, help="Hugging Face folder; default: embedded")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None, help="sampling seed of every prompt")
    parser.add_argument("--json", action="store_true", help="one JSON object per prompt")
    return parser


def generate_main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    from kvflow.runtime.engine import Engine

    params = {
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "seed": args.seed,
    }
    try:
        engine = Engine(args.model_path)
        results = engine.generate(list(args.prompts), params)
    except ValueError as err:
        print(f"kvflow generate: {err}", file=sys.stderr)
        return 2
    for prompt, result in zip(args.prompts, results, strict=True):
        if args.json:
            record = {
                "prompt": prompt,
                "text": result.text,
                "output_ids": result.output_ids,
                "finish_reason": result.finish_reason.type,
                "usage": vars(result.usage),
            }
            print(json.dumps(record, ensure_ascii=False))
        else:
            print(result.text)
    return 0
