"""LoRA tests: tiny random Llama checkpoints with random PEFT adapters (lora_adapters.py)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "server"))  # server_process
