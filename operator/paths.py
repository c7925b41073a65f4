"""Where the operator puts things inside pods: its volumes' names and mount paths.

User volumes (``volumes`` / ``volumeMounts`` of a role) must not take these names or paths;
``parse.py`` and the CRD refuse them.
"""

from __future__ import annotations

from kvflow import contract

CACHE_DIR = "/var/cache/kvflow"  # converted/embedded models, Hugging Face cache
MODEL_DIR = "/models"
HICACHE_DIR = "/var/lib/kvflow/hicache"
TMP_DIR = "/tmp"
SHM_DIR = "/dev/shm"
CONFIG_DIR = contract.RUNTIME_CONFIG_DIR

# Volume name -> mount path, for every volume the operator itself may render.
OPERATOR_VOLUMES = {
    "cache": CACHE_DIR,
    "tmp": TMP_DIR,
    "shm": SHM_DIR,
    "config": CONFIG_DIR,
    "model": MODEL_DIR,
    "hicache": HICACHE_DIR,
}
