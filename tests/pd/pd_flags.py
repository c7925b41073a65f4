"""Flags of every server in the PD tests."""

# A small chunk so long prompts prefill in several chunks on the prefill side.
COMMON = ("--max-total-tokens", "6000", "--context-length", "2048", "--chunked-prefill-size", "64")
