"""splitserve: disaggregated LLM serving (Splitwise) with Sarathi-Serve chunked-prefill batching."""
from splitserve.engine.llm import LLM
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.outputs import CompletionOutput, RequestOutput
from splitserve.engine.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
