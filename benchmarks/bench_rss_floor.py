"""Where the CPU model process's resident memory goes (issue 35): the process's RSS after
each step of what the scheduler process does, each library measured in a fresh process.

1. ``import torch`` (PyPI's wheel links its CUDA libraries whether or not a GPU exists);
2. each CUDA library ``libtorch_cuda.so`` needs, loaded alone with ``dlopen`` (what loading
   it costs without torch around it);
3. kvflow's engine on the embedded model (``--max-total-tokens``: the KV pool is allocated
   untouched, so it is not resident until requests write it), and the CPU tensors it
   holds, by storage.

    python -P benchmarks/bench_rss_floor.py [--max-total-tokens 16384] [--out rss-floor.md]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

_RSS = """
def rss_mb():
    for line in open('/proc/self/status'):
        if line.startswith('VmRSS'):
            return int(line.split()[1]) / 1024
"""

_TORCH = (
    _RSS
    + """
import json
before = rss_mb()
import torch
print(json.dumps({"python": before, "import torch": rss_mb(), "torch": torch.__version__,
                  "cuda build": torch.version.cuda}))
"""
)

_LIB = (
    _RSS
    + """
import ctypes, json, sys
before = rss_mb()
ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_GLOBAL)
print(json.dumps({"dlopen MB": rss_mb() - before}))
"""
)

_ENGINE = (
    _RSS
    + """
import gc, json, sys
import torch
from kvflow.runtime.engine import Engine
base = rss_mb()
engine = Engine(max_total_tokens=int(sys.argv[1]), skip_tokenizer_init=True)
gc.collect()
after = rss_mb()
storages = {}
for obj in gc.get_objects():
    try:
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
            s = obj.untyped_storage()
            storages[s.data_ptr()] = s.nbytes()
    except Exception:
        pass
print(json.dumps({"imports (torch, kvflow)": base, "engine built": after,
                  "CPU tensor storage MB": sum(storages.values()) / 2**20,
                  "largest storage MB": max(storages.values()) / 2**20}))
"""
)


def _run(code: str, *args: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-P", "-c", code, *args], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def _cuda_libraries() -> list[Path]:
    import torch  # the wheel's folders

    lib = Path(torch.__file__).parent / "lib" / "libtorch_cuda.so"
    if not lib.exists():
        return []
    needed = subprocess.run(["ldd", str(lib)], capture_output=True, text=True).stdout
    paths = []
    for line in needed.splitlines():
        parts = line.split("=>")
        if len(parts) == 2 and ("nvidia" in parts[1] or "libcu" in parts[0]):
            path = parts[1].split("(")[0].strip()
            if path and path != "not found":
                paths.append(Path(path))
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-total-tokens", type=int, default=16384)
    parser.add_argument("--out", type=Path, default=None, help="markdown report")
    args = parser.parse_args()
    torch_rss = _run(_TORCH)
    libs = {p.name: round(_run(_LIB, str(p))["dlopen MB"], 1) for p in _cuda_libraries()}
    engine = _run(_ENGINE, str(args.max_total_tokens))
    result = {"torch": torch_rss, "cuda libraries (dlopen alone, MB)": libs, "engine": engine}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.write_text(
            "# Resident memory floor of the CPU model process\n\n"
            f"    python -P benchmarks/bench_rss_floor.py --max-total-tokens "
            f"{args.max_total_tokens} --out {args.out}\n\n```json\n{text}\n```\n"
        )


if __name__ == "__main__":
    main()
