from kvflow.runtime.utils.registry import Registry

__all__ = ["Registry"]
