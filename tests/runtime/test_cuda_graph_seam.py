"""The CUDA-graph runner takes any attention backend with capture buffers: the check the
model runner makes before capturing (that ``cuda_graph`` imports nothing of the model
runner is checked with the other import floors in ``test_import_layers.py``)."""

from __future__ import annotations


def test_only_backends_with_capture_buffers_are_graph_attention():
    from kvflow.runtime.attention import ATTENTION_BACKENDS
    from kvflow.runtime.cuda_graph import GraphAttention

    assert issubclass(ATTENTION_BACKENDS.get("triton"), GraphAttention)
    for name in ("torch", "cpu"):
        assert not issubclass(ATTENTION_BACKENDS.get(name), GraphAttention)
