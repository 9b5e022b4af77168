"""One sampled row over SmolLM2's 49,152-token vocabulary, ms per draw: two versions of
stratum/engine/sampler.py side by side (another checkout's and this tree's; the same file twice times one),
best of 5 runs of 40 draws, one thread.
usage: python scripts/perf/sampler_bench.py OLD_SAMPLER_PY NEW_SAMPLER_PY"""
import importlib.util
import json
import sys
import time

import torch

from stratum.engine.sampling_params import SamplingParams

torch.set_num_threads(1)


def load(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    m = importlib.util.module_from_spec(spec)
    sys.modules[name] = m
    spec.loader.exec_module(m)
    return m


old, new = load(sys.argv[1], "old"), load(sys.argv[2], "new")
logits = torch.randn(1, 49152, generator=torch.Generator().manual_seed(0)) * 3
res = {}
for label, p in [("greedy", SamplingParams(temperature=0.0)), ("temperature 1.0", SamplingParams(temperature=1.0)),
                 ("temperature 0.7, top_p 0.9", SamplingParams(temperature=0.7, top_p=0.9)),
                 ("temperature 1.0, top_k 50", SamplingParams(temperature=1.0, top_k=50))]:
    for m in (old, new):
        best = 1e9
        for _ in range(5):
            t = time.perf_counter()
            for _ in range(40):
                m.sample(logits.clone(), [p], [None])
            best = min(best, (time.perf_counter() - t) / 40)
        res.setdefault(label, {})[m.__name__] = round(best * 1e3, 3)
print(json.dumps({"unit": "ms per draw (best of 5 x 40), 1 thread", "results": res}, indent=1))
