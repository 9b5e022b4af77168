"""Constrained decoding: a request's grammar decides which tokens it may sample next.

Grammars are llguidance grammars (Lark-like text, with JSON schemas inline through `%json`), the
library vLLM and SGLang also run. Each constrained request holds an `LLMatcher`; before sampling,
the masks of every constrained row of the step are computed together (in parallel, outside the
interpreter lock) and applied to their logits. Requests without a grammar never reach this module.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from stratum.engine.sampling_params import InvalidRequestError

if TYPE_CHECKING:  # the serving side validates grammars here without loading torch
    import torch

_executor = None
_lock = threading.Lock()

# A constrained answer this close to max_tokens that its grammar is not yet complete is steered to
# close what it has open: where the grammar allows them, only tokens that close a string, an array or
# an object are offered. Without it, an answer that runs on (a long string, a growing array) is cut
# by max_tokens into invalid JSON; with it, it ends valid. 32 tokens close a few levels of nesting
# and a tool call's closing tag.
WIND_DOWN_TOKENS = 32
_CLOSING = frozenset(b'"}]')


def check(grammar: str) -> None:
    """Validate a grammar without a tokenizer (the serving side calls this before admission).

    Raises:
        InvalidRequestError: the grammar (or a schema inside it) cannot be compiled; the message says why.
    """
    import llguidance

    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise InvalidRequestError(messages[0] if messages else "invalid grammar")


class GrammarCompiler:
    """Matchers for one tokenizer. The llguidance view of the vocabulary is built on first use
    (about 0.3 s for a 49k vocabulary) and kept."""

    def __init__(self, tokenizer, vocab_size: int):
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._ll = None
        self._closers: "tuple[torch.Tensor, torch.Tensor] | None" = None

    @property
    def closers(self) -> "tuple[torch.Tensor, torch.Tensor]":
        """Two [vocab] bool masks of tokens made only of quotes, brackets and braces (and a newline):
        those that begin with a quote (they end a string), and those that begin with a bracket."""
        if self._closers is None:
            import torch

            quote = torch.zeros(self.vocab_size, dtype=torch.bool)
            bracket = torch.zeros(self.vocab_size, dtype=torch.bool)
            for i in range(min(self.vocab_size, self._tokenizer.vocab_size)):
                raw = self._tokenizer.token_bytes(i).rstrip(b"\n")
                if raw and all(b in _CLOSING for b in raw):
                    (quote if raw[0] == ord('"') else bracket)[i] = True
            self._closers = quote, bracket
        return self._closers

    def _ll_tokenizer(self):
        """llguidance's view of the vocabulary. A byte-level BPE one is given as each token's bytes, the
        special tokens marked: from the tokenizer's JSON, llguidance reads every added token as
        special, and an added token that is text (Qwen's `<tool_call>`, `<think>`) would never match the
        text a grammar spells it with. Other vocabularies (SentencePiece) go as their JSON, whose
        dummy-prefix space llguidance knows."""
        if self._ll is None:
            import llguidance

            tok = self._tokenizer
            source = tok.backend.to_str()
            if _is_byte_level(source):
                source = llguidance.TokenizerWrapper(_Vocabulary(tok, self.vocab_size))
            self._ll = llguidance.LLTokenizer(source, n_vocab=self.vocab_size,
                                              eos_token=list(tok.eos_token_ids) or None)
        return self._ll

    def matcher(self, grammar: str):
        """A fresh matcher at the grammar's start.

        Raises:
            InvalidRequestError: the grammar does not compile for this vocabulary.
        """
        import llguidance

        m = llguidance.LLMatcher(self._ll_tokenizer(), grammar, log_level=0)
        if m.is_error():
            raise InvalidRequestError(f"grammar: {m.get_error()}")
        return m


def _is_byte_level(tokenizer_json: str) -> bool:
    import json

    decoder = json.loads(tokenizer_json).get("decoder") or {}
    return "ByteLevel" in [decoder.get("type"), *(d.get("type") for d in decoder.get("decoders") or [])]


class _Vocabulary:
    """A tokenizer as llguidance's `TokenizerWrapper` reads one: token bytes by id (a special token's
    begin with 0xff, which no text holds: llguidance's mark for one), the special ids, text -> ids."""

    def __init__(self, tokenizer, vocab_size: int):
        self._tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_token_ids[0] if tokenizer.eos_token_ids else None
        self.bos_token_id = tokenizer.bos_token_id
        special = {i for i, t in tokenizer.backend.get_added_tokens_decoder().items() if t.special}
        self.tokens = [b"\xff" * (i in special) + tokenizer.token_bytes(i) for i in range(vocab_size)]
        self.special_token_ids = sorted(i for i in special if i < vocab_size)

    def __call__(self, text: str) -> list[int]:
        return self._tokenizer.encode(text)


def wind_down(allowed: "torch.Tensor", closers: "tuple[torch.Tensor, torch.Tensor]") -> "torch.Tensor":
    """Of the allowed tokens, those that end a string if any is allowed here (inside a string a brace
    is just a character), else those that close an array or object, else all of them."""
    for kind in closers:
        closing = allowed & kind
        if bool(closing.any()):
            return closing
    return allowed


def allowed_tokens(matchers: list, vocab_size: int) -> "torch.Tensor":
    """[len(matchers), vocab_size] bool: the tokens each matcher accepts next, computed in parallel."""
    global _executor
    import llguidance
    import numpy as np
    import torch

    words = (vocab_size + 31) // 32
    bitmask = np.empty((len(matchers), words), dtype=np.int32)
    if _executor is None:
        with _lock:
            _executor = _executor or llguidance.LLExecutor()
    _executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)], bitmask.ctypes.data,
                                      words * 4, len(matchers))
    bits = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[:, :vocab_size]
    return torch.from_numpy(bits).bool()
