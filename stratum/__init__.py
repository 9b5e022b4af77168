"""Stratum: an LLM serving runtime whose orchestration layer lives inside the runtime."""

from stratum.sampling_params import SamplingParams

__version__ = "0.1.0"

__all__ = ["SamplingParams", "__version__"]
