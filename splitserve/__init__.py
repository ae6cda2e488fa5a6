"""splitserve: disaggregated LLM serving (Splitwise) with Sarathi-Serve chunked-prefill batching."""
from importlib import import_module

# Loaded on first use, so the parts that need no torch (placement, simulator, bench) start fast.
_EXPORTS = {"LLM": "splitserve.engine.llm", "LLMEngine": "splitserve.engine.llm_engine",
            "SamplingParams": "splitserve.engine.sampling_params", "RequestOutput": "splitserve.engine.outputs",
            "CompletionOutput": "splitserve.engine.outputs"}

__all__ = list(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'splitserve' has no attribute {name!r}")
    return getattr(import_module(_EXPORTS[name]), name)
