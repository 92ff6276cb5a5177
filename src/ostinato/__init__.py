"""ostinato: an LLM inference engine whose decode step is one CUDA-graph replay."""

from ostinato.sampling_params import RequestOutputKind, SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "RequestOutputKind", "SamplingParams", "__version__"]


def __getattr__(name: str):
    # LLM pulls in torch and transformers; import it lazily so `import ostinato` stays cheap.
    if name == "LLM":
        from ostinato.engine.llm import LLM

        return LLM
    raise AttributeError(name)
