"""pcgspec: LLM inference with piecewise CUDA graphs and graph-captured speculative decoding."""

from pcgspec.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput"]
__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    # NOTE: LLM pulls in torch models and transformers; import it only when asked for.
    if name == "LLM":
        from pcgspec.llm import LLM

        return LLM
    if name == "RequestOutput":
        from pcgspec.outputs import RequestOutput

        return RequestOutput
    raise AttributeError(f"module 'pcgspec' has no attribute {name!r}")
