"""The embedded GGUF is converted in a child process that exits, so the process that goes
on to serve never holds the conversion's memory (transformers, two float32 copies of the
model) beside the scheduler's copy: in a container with a memory limit that sum was what
got the pod OOM-killed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from kvflow.runtime.models.embedded import embedded_model_path

PROBE = """
import json, resource, sys
from kvflow.runtime.models.embedded import embedded_model_path
path = embedded_model_path()
# VmHWM: this process's own peak (ru_maxrss of RUSAGE_SELF would start at the RSS of the
# process that forked it, pytest's, which may be large by then)
hwm = next(l for l in open("/proc/self/status") if l.startswith("VmHWM:"))
print(json.dumps({
    "path": str(path),
    "transformers_imported": "transformers" in sys.modules,
    "torch_imported": "torch" in sys.modules,
    "self_max_rss_kb": int(hwm.split()[1]),
    "children_max_rss_kb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss,
}))
"""


def test_conversion_runs_in_a_child_that_exits(tmp_path: Path) -> None:
    env = {**os.environ, "KVFLOW_CACHE_DIR": str(tmp_path / "cache")}
    done = subprocess.run(
        [sys.executable, "-P", "-c", PROBE],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    report = json.loads(done.stdout.strip().splitlines()[-1])
    converted = Path(report["path"])
    assert converted == tmp_path / "cache" / "models" / "SmolLM2-135M-Instruct"
    assert (converted / ".kvflow-converted").is_file()
    # The caller never imported the converter's libraries nor grew to the conversion's peak:
    # the child did (about 1.9 GB on this machine).
    assert not report["transformers_imported"] and not report["torch_imported"]
    assert report["children_max_rss_kb"] > 1_000_000, report
    assert report["self_max_rss_kb"] < 200_000, report
    # The same folder the cache already holds, tensor for tensor (conversion is deterministic).
    reference = embedded_model_path()
    for name in ("config.json", "tokenizer.json"):
        assert (converted / name).read_bytes() == (reference / name).read_bytes(), name
    assert (converted / "model.safetensors").read_bytes() == (
        reference / "model.safetensors"
    ).read_bytes()
