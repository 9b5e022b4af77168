"""The offline API: generate a list of prompts to completion, batched together."""

from __future__ import annotations

import itertools

from stratum.engine.config import EngineConfig
from stratum.engine.core import EngineCore
from stratum.engine.outputs import RequestOutput
from stratum.engine.sampling_params import SamplingParams
from stratum.models.loader import Checkpoint


class LLM:
    """Offline generation: `LLM("smollm2-135m").generate(prompts, SamplingParams(...))`."""

    def __init__(self, model: str = "smollm2-135m", checkpoint: Checkpoint | None = None, **config):
        self.engine = EngineCore(EngineConfig(model=model, **config), checkpoint=checkpoint)
        self._ids = itertools.count()

    def generate(self, prompts: list[str] | list[list[int]],
                 sampling: SamplingParams | list[SamplingParams] | None = None,
                 priorities: list[int] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion, batched together. Strings are tokenized as plain text."""
        sampling = sampling or SamplingParams()
        params = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
        order = []
        for i, prompt in enumerate(prompts):
            ids = self.engine.tokenizer.encode_prompt(prompt) if isinstance(prompt, str) else list(prompt)
            rid = f"offline-{next(self._ids)}"
            self.engine.add_request(ids, params[i], request_id=rid, priority=priorities[i] if priorities else 0)
            order.append(rid)
        finals: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.finished:
                    finals[out.request_id] = out
        return [finals[rid] for rid in order]

    def chat(self, messages: list[dict], sampling: SamplingParams | None = None) -> RequestOutput:
        ids = self.engine.chat_template.encode(messages)
        return self.generate([ids], sampling)[0]
