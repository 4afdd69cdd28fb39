"""minipaged: PagedAttention rebuilt step by step.

    from minipaged import LLM, SamplingParams
    llm = LLM()                      # the embedded SmolLM2-135M-Instruct
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0))
"""
from minipaged.engine.llm_engine import LLMEngine
from minipaged.entrypoints.llm import LLM
from minipaged.outputs import CompletionOutput, RequestOutput
from minipaged.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
