"""Model families checked against transformers on tiny random-weight checkpoints."""

from __future__ import annotations

import sys
from pathlib import Path

# tests/parallel/tp_ranks.py runs an engine per tensor-parallel rank; its spawned ranks
# import it by module name, so its folder goes on the path (which they inherit).
sys.path.insert(0, str(Path(__file__).parents[1] / "parallel"))
