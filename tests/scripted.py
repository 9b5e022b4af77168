"""Scripted tiny models: random-weight models of a real family shape and template whose greedy output
follows a script, so tests can make a model think, answer and call tools in a family's own markers.

Every piece of a script is one token (pieces the tiny vocabulary does not hold as one are added to it,
as non-special added tokens, the way Qwen3's `<think>` is). The weights make each token's greedy next
token its successor in the script: no layer writes to the residual stream (attention and MLP outputs
are zeroed), so the last hidden state is the token's own embedding, and the output head maps each
token's embedding to its successor's logit. A token with no successor ends the answer (a constant
embedding dimension scores the end-of-sequence token just below any successor).

    script ["\\n", "<think>", "\\nLet me see", "</think>", "\\n\\n", "Paris."]
    prompt ... <|im_start|>assistant\\n  ->  <think> \\nLet me see </think> \\n\\n Paris. <|im_end|>
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.factories import make_tiny_model_dir

QWEN3_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QWEN3_ADDED = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
TEMPLATES = Path(__file__).parent / "data" / "chat_templates"


def template(name: str) -> str:
    return (TEMPLATES / f"{name}.jinja").read_text()


def make_scripted_model(path: Path, chat_template: str, scripts: list[list[str]], added: list[str] = (),
                        eos: str = "<|im_end|>", hidden: int = 64, seed: int = 0) -> Path:
    """A Qwen3-shaped Hugging Face folder (config.json, model.safetensors, tokenizer.json,
    tokenizer_config.json with `chat_template`) whose greedy continuation of each script's first piece
    is the rest of that script, then `eos`.

    Args:
        scripts: each a list of pieces; a piece may appear in several scripts only with the same
            successor (a token has one greedy next token); a script that ends on a piece it had before
            loops back to it.
        added: tokens added to the vocabulary besides the scripts' pieces (a family's markers).
    Raises:
        AssertionError: two scripts give one token different successors, or the weights do not make
            every scripted token's successor its argmax.
    """
    import transformers
    from tokenizers import AddedToken, Tokenizer

    path = Path(path)
    make_tiny_model_dir(path, num_layers=1, hidden=hidden, seed=seed)  # the tiny BPE vocabulary; the rest is replaced
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    pieces = [p for script in scripts for p in script]
    new = [p for p in dict.fromkeys([*added, *pieces]) if len(tok.encode(p, add_special_tokens=False).ids) != 1
           or p in added]
    tok.add_tokens([AddedToken(p, special=False, normalized=False) for p in new if tok.token_to_id(p) is None])
    tok.save(str(path / "tokenizer.json"))

    def token(piece: str) -> int:
        ids = tok.encode(piece, add_special_tokens=False).ids
        assert len(ids) == 1, (piece, ids)
        return ids[0]

    successor: dict[int, int] = {}
    for script in scripts:  # a script whose last piece came earlier loops back to it (no end)
        ends = [] if script[-1] in script[:-1] else [eos]
        for a, b in zip(script, script[1:] + ends):
            ta, tb = token(a), tok.token_to_id(b) if b == eos else token(b)
            assert successor.setdefault(ta, tb) == tb, f"{a!r} has two successors"
    vocab = tok.get_vocab_size(with_added_tokens=True)
    config = transformers.Qwen3Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, max_position_embeddings=4096,
        rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=None, eos_token_id=tok.token_to_id(eos))
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    directions = torch.nn.functional.normalize(torch.randn(vocab, hidden - 1, generator=g), dim=-1)
    embed = torch.cat([torch.ones(vocab, 1), directions], dim=1)  # dimension 0: a constant 1
    head = torch.zeros(vocab, hidden)
    for a, b in successor.items():
        head[b, 1:] += 2.0 * directions[a]
    head[config.eos_token_id, 0] = 1.0  # the end of the answer wherever no successor is scripted
    state = model.state_dict()
    with torch.no_grad():
        for name, tensor in state.items():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                tensor.zero_()
            elif "norm" in name:
                tensor.fill_(1.0)
        state["model.embed_tokens.weight"].copy_(embed)
        state["lm_head.weight"].copy_(head)
    logits = head @ (embed / embed.pow(2).mean(-1, keepdim=True).sqrt()).T  # [next, current]
    for a, b in successor.items():
        assert int(logits[:, a].argmax()) == b, f"token {a}'s argmax is not its successor"
    model.save_pretrained(str(path), safe_serialization=True)
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": None, "eos_token": eos, "chat_template": chat_template,
        "added_tokens_decoder": {str(i): {"content": t.content, "special": t.special}
                                 for i, t in tok.get_added_tokens_decoder().items()},
    }))
    return path


def write_scripted_gguf(folder: Path, out: Path, chat_template: str) -> Path:
    """A scripted folder as a GGUF, the way llama.cpp's converter writes a Qwen3 file (its added
    tokens user-defined), with the template in its metadata."""
    from tests.factories import write_family_gguf

    return write_family_gguf(Path(folder), Path(out), chat_template=chat_template)
