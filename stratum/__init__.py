"""Stratum: an LLM serving runtime whose orchestration layer lives inside the runtime."""

__version__ = "0.1.0"

__all__ = ["SamplingParams", "__version__"]


def __getattr__(name: str):
    if name == "SamplingParams":  # imported on first use: `import stratum.client` loads no engine code
        from stratum.engine.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'stratum' has no attribute {name!r}")
