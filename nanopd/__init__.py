"""nanoPD: a small, readable and fast LLM inference engine that separates prefill from decode.

    from nanopd import LLM, SamplingParams
    outs = LLM("tiny").generate(["Hello"], SamplingParams(max_tokens=32, temperature=0))

The API is vLLM's (llm.py); `python -m nanopd` is the command line (__main__.py). Every
module of the engine is a file of this folder, read top to bottom (the README's map).
"""

from nanopd.llm import LLM
from nanopd.request import (
    BeamSearchOutput,
    BeamSearchParams,
    BeamSearchSequence,
    CompletionOutput,
    RequestMetrics,
    RequestOutput,
    SamplingParams,
    TextPrompt,
    TokensPrompt,
)

__all__ = ["LLM", "BeamSearchOutput", "BeamSearchParams", "BeamSearchSequence", "CompletionOutput",
           "RequestMetrics", "RequestOutput", "SamplingParams", "TextPrompt", "TokensPrompt"]
