"""pcgspec: LLM inference with piecewise CUDA graphs and graph-captured speculative decoding."""

from pcgspec.registry import lazy_exports
from pcgspec.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "Logprob"]
__version__ = "0.1.0"

# NOTE: LLM pulls in the models and transformers; import it only when asked for.
__getattr__ = lazy_exports(
    __name__,
    {"LLM": "pcgspec.llm", "RequestOutput": "pcgspec.outputs", "Logprob": "pcgspec.outputs"},
)
