"""The runtime core: a request's state, the scheduler, the KV block manager and radix cache, the model
runner, sampler and detokenizer, the synchronous engine with its basic mode, the offline `LLM`, the
engine loop and the client the server talks to. It imports no web framework.

Names are imported on first use, so `import stratum.engine.outputs` (plain data) loads no torch.
"""

import importlib

_EXPORTS = {
    "EngineClient": "client", "EngineSnapshot": "protocol", "QueueFull": "client", "RequestStream": "client",
    "start_thread_engine": "thread_transport",
    "EngineConfig": "config", "ResolvedConfig": "config", "SchedulerConfig": "config",
    "EngineCore": "core", "LLM": "llm",
    "EngineDeadError": "outputs", "OrchestrationError": "outputs", "RequestOutput": "outputs",
    "RequestStats": "outputs",
    "StepError": "outputs", "StepStats": "outputs",
    "InvalidRequestError": "sampling_params", "SamplingParams": "sampling_params",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'stratum.engine' has no attribute {name!r}")
    return getattr(importlib.import_module(f"stratum.engine.{_EXPORTS[name]}"), name)
