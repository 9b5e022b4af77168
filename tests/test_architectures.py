"""Every supported family against Hugging Face transformers, from an HF folder and from a GGUF.

Each family's tiny random-weight model is built by transformers (tests/factories.py: config -> seeded
random init -> save_pretrained) and converted to GGUF the way llama.cpp's converter writes it. The
engine runs two prompts as one batch with a small chunk budget — chunked prefill against cached slots,
a batch of decodes — with windows and caps small enough that the prompts cross them. Its log-probs at
every position must match transformers' fp32 eager model, and its greedy continuation must be
transformers' `generate`.
"""

from __future__ import annotations

import pytest
import torch

from stratum.engine import LLM
from stratum.engine.request import CachePolicy
from stratum.engine.sampling_params import SamplingParams
from stratum.engine.config import SchedulerConfig
from tests.factories import FAMILY_CONFIGS, GGUF_ARCH, make_family_dir, write_family_gguf

transformers = pytest.importorskip("transformers")

# fp32 on both sides; the difference is summation order (measured: at most ~2e-5 here)
LOGPROB_ATOL = 2e-4
PROMPTS = [
    "The capital of Japan is Tokyo. The capital of Germany is Berlin. def add(a, b):\n    return a + b",
    "Once upon a time there was a small model that answered questions about cities.",
]
MAX_TOKENS = 8


pytestmark = pytest.mark.usefixtures("module_stratum_home")  # checkpoint caches of its own


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    made: dict[str, object] = {}

    def get(family: str):
        if family not in made:
            made[family] = make_family_dir(tmp_path_factory.mktemp(f"tiny-{family}"), family)
        return made[family]

    return get


def engine_llm(path) -> LLM:
    # the PyTorch model: the native step's own parity is tests/test_packed_step.py's
    return LLM(str(path), dtype="float32", device="cpu", num_kv_blocks=64, int4_max_tokens=0, native_step=False,
               scheduler=SchedulerConfig(max_num_batched_tokens=24))


def run_batch(llm: LLM, prompts: list[list[int]]):
    engine = llm.engine
    sampling = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, return_logits=True)
    seqs = [engine.add_request(ids, sampling, cache_policy=CachePolicy.bypass()) for ids in prompts]
    while engine.has_unfinished():
        engine.step()
    return seqs


@pytest.mark.parametrize("source", ["hf", "gguf"])
@pytest.mark.parametrize("family", list(FAMILY_CONFIGS))
def test_family_matches_transformers(folders, family, source, tmp_path):
    folder = folders(family)
    path = folder if source == "hf" else write_family_gguf(folder, tmp_path / f"{family}.gguf")
    llm = engine_llm(path)
    # Mistral GGUFs are "llama"
    assert llm.engine.model_config.architecture == (family if source == "hf" else GGUF_ARCH[family])
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32,
                                                             attn_implementation="eager").eval()
    tok = llm.engine.tokenizer
    prompts = [tok.encode(p) for p in PROMPTS]
    assert len(prompts[0]) > 2 * 8  # crosses the sliding windows of the families that have one
    for prompt, seq in zip(prompts, run_batch(llm, prompts)):
        full = list(seq.token_ids)
        with torch.no_grad():
            ref_logits = ref(torch.tensor([full])).logits[0, :-1].float()
            generated = ref.generate(torch.tensor([prompt]),
                                     attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                     max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
        ours = torch.stack([seq.readouts.logits[p] for p in range(len(full) - 1)])
        diff = (ours.log_softmax(-1) - ref_logits.log_softmax(-1)).abs().amax(-1)
        assert diff.max() <= LOGPROB_ATOL, (f"{family}/{source}: position {int(diff.argmax())}: "
                                            f"|logprob diff| {diff.max():.2e}")
        assert full[len(prompt):] == generated[0, len(prompt):].tolist(), f"{family}/{source}: greedy tokens differ"
