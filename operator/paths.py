"""Where the operator puts things inside pods: its volumes' names and mount paths, and the
environment variables it sets.

User volumes (``volumes`` / ``volumeMounts`` of a role) must not take these names or paths,
nor a role's ``env`` these variables' names (a second entry of one name makes every apply of
the Deployment fail); ``parse.py`` and the CRD refuse them.
"""

from __future__ import annotations

from kvflow import contract

CACHE_DIR = "/var/cache/kvflow"  # converted/embedded models, Hugging Face cache
MODEL_DIR = "/models"
HICACHE_DIR = "/var/lib/kvflow/hicache"
ADAPTERS_DIR = "/adapters"  # LoRA adapters from claims and the Hub (operator/lora.py)
TMP_DIR = "/tmp"
SHM_DIR = "/dev/shm"
CONFIG_DIR = contract.RUNTIME_CONFIG_DIR
HF_HOME_ENV = "HF_HOME"

# Volume name -> mount path, for every volume the operator itself may render.
OPERATOR_VOLUMES = {
    "cache": CACHE_DIR,
    "tmp": TMP_DIR,
    "shm": SHM_DIR,
    "config": CONFIG_DIR,
    "model": MODEL_DIR,
    "hicache": HICACHE_DIR,
    "lora-hf": f"{ADAPTERS_DIR}/hf",
}

# Every environment variable the operator may set in a container of any role.
OPERATOR_ENV = (
    contract.POD_IP_ENV,
    contract.MODEL_CACHE_ENV,
    HF_HOME_ENV,
    contract.API_KEY_ENV,
    contract.INTERNAL_KEY_ENV,
    contract.MOONCAKE_CONFIG_ENV,
)
