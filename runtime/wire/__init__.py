"""What crosses process and package boundaries, importable without torch.

The HTTP layer, the scheduler process and the router all speak these types: sampling
parameters as validated at the edge, per-step token outputs and finish reasons, the
messages between the runtime's processes, and the OpenAI-shaped error body. Nothing here
imports torch, numpy or transformers (``tests/router`` checks it with them blocked).
"""

from kvflow.runtime.wire.disagg import Bootstrap
from kvflow.runtime.wire.errors import RequestError, error_body
from kvflow.runtime.wire.messages import GenerateRequest
from kvflow.runtime.wire.outputs import FinishReason, TokenOutput
from kvflow.runtime.wire.sampling import SamplingParams

__all__ = [
    "Bootstrap",
    "FinishReason",
    "GenerateRequest",
    "RequestError",
    "SamplingParams",
    "TokenOutput",
    "error_body",
]
