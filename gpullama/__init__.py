"""gpullama: LLM inference for GGUF models with a continuous-batching engine and an OpenAI-compatible server."""

from gpullama.llm import LLM
from gpullama.outputs import Completion, StreamDelta, TokenLogprob, TopLogprob
from gpullama.sampling_params import SamplingParams

__all__ = ["LLM", "Completion", "SamplingParams", "StreamDelta", "TokenLogprob", "TopLogprob"]
__version__ = "0.1.0"
