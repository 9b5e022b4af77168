"""Tokenizers: Hugging Face `tokenizers` built from tokenizer.json or from a GGUF vocabulary.

Text that comes from a user (message content, tool output) is always encoded with special tokens
disabled, so "<|im_start|>" typed by a user is plain text and cannot forge a chat turn.
"""

from __future__ import annotations

import functools
import logging
import os
import subprocess
import sys
import threading
from array import array
from dataclasses import dataclass, field

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

# Pre-tokenizer split patterns by GGUF `tokenizer.ggml.pre`, as llama.cpp's llama-vocab.cpp defines them.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}
# These split every digit on its own before the GPT-2 pattern (llama.cpp: STARCODER, SMOLLM, ...).
_DIGIT_SPLIT = {"smollm", "starcoder", "refact", "codeshell"}

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types

log = logging.getLogger("stratum.tokenizer")


@dataclass
class TextTokenizer:
    """A `tokenizers.Tokenizer` plus the ids a serving runtime needs. Safe to use from several threads."""

    backend: Tokenizer
    bos_token: str | None = None
    eos_token: str | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    _plain: Tokenizer | None = field(default=None, init=False, repr=False)  # see `plain`
    _helper: "_HelperProcess | None" = field(default=None, init=False, repr=False)  # see offload_large_texts
    _offload_chars: int = field(default=0, init=False, repr=False)

    @property
    def plain(self) -> Tokenizer:
        """A copy of backend that reads special-token strings as plain text: a second object rather
        than a flag toggled around each call, which another thread could see set the wrong way.
        Built on first use (0.14 s for a 49k vocabulary), which an engine process never makes; two
        threads that race to build it build equal copies, and one is kept."""
        plain = self._plain
        if plain is None:
            plain = Tokenizer.from_str(self.backend.to_str())
            plain.encode_special_tokens = True
            self._plain = plain
        return plain

    def offload_large_texts(self, min_chars: int) -> None:
        """From now on, encode texts of at least min_chars characters in a helper process.

        `encode_batch` releases the interpreter lock for most of its work but not all of it: for a
        3.8 MB text it held the lock about 100 ms, and building its 1.4 M-id list about 60 ms more,
        time in which a server's event loop serves nobody. With the helper only the ids' list is
        built here. Same tokenizer, same ids; if the helper fails, this process encodes again.
        """
        self._helper = _HelperProcess(self.backend.to_str())  # started on the first large text
        self._offload_chars = min_chars

    def close(self) -> None:
        if self._helper is not None:
            self._helper.close()
            self._helper = None

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, allow_special: bool = False) -> list[int]:
        """Encode without adding BOS/EOS. With allow_special False, special-token strings are plain text.

        A batch of one: `encode_batch` releases the interpreter lock while it runs, so a long text
        tokenized in a worker thread does not stall the event loop (see also `offload_large_texts`)."""
        helper = self._helper
        if helper is not None and len(text) >= self._offload_chars:
            try:
                return helper.encode(text, allow_special)
            except (OSError, EOFError, ValueError) as e:
                log.warning("tokenizer helper failed (%s); encoding in this process", e)
                self._helper = None
        return (self.backend if allow_special else self.plain).encode_batch([text], add_special_tokens=False)[0].ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (a byte-level BPE token may hold part of a UTF-8 character)."""
        piece = self.backend.id_to_token(token_id)
        if piece is None:
            return b""
        if token_id in self._special_ids:
            return piece.encode()
        table = _byte_decoder()
        if all(ch in table for ch in piece):
            return bytes(table[ch] for ch in piece)
        return self.backend.decode([token_id], skip_special_tokens=False).encode()

    @functools.cached_property
    def _special_ids(self) -> set[int]:
        return set(self.backend.get_added_tokens_decoder())


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """Byte-level BPE's printable stand-in character -> the byte it stands for (GPT-2's table: printable
    Latin-1 bytes stand for themselves, the other 68 are shifted to code points from 256 up)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    shift = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + shift)
            shift += 1
    return {chr(c): b for b, c in zip(printable, chars)}


HELPER_NICENESS = 10  # the helper's scheduling priority below the server's and the engine's


class _HelperProcess:
    """`python -m stratum.models.tokenizer`: the same tokenizer in a process of its own, one request
    at a time over its stdin/stdout as msgpack frames ([text, allow_special] -> uint32 ids as bytes)."""

    def __init__(self, tokenizer_json: str):
        import msgpack

        self._msgpack = msgpack
        self._tokenizer_json = tokenizer_json
        self.proc: subprocess.Popen | None = None  # started on first use: it costs nothing until a large text comes
        self._lock = threading.Lock()
        self._unpacker = msgpack.Unpacker(raw=False, max_buffer_size=1 << 30)

    def _start(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "stratum.models.tokenizer"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE)
        try:  # a large text is background work: the engine and the event loop come first for the CPU
            os.setpriority(os.PRIO_PROCESS, self.proc.pid, HELPER_NICENESS)
        except (AttributeError, OSError):
            pass
        self._send(self._tokenizer_json)

    def _send(self, obj) -> None:
        self.proc.stdin.write(self._msgpack.packb(obj, use_bin_type=True))
        self.proc.stdin.flush()

    def encode(self, text: str, allow_special: bool) -> list[int]:
        with self._lock:
            if self.proc is None:
                self._start()
            self._send([text, allow_special])
            while True:
                for reply in self._unpacker:
                    return _to_list(array("I", reply))
                data = self.proc.stdout.read1(1 << 20)
                if not data:
                    raise EOFError("the tokenizer helper exited")
                self._unpacker.feed(data)

    def close(self) -> None:
        if self.proc is None:
            return
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        self.proc.wait(timeout=10)


_LIST_SLICE = 1 << 16


def _to_list(ids: array) -> list[int]:
    """ids as a list, converted a slice at a time: one `tolist` of a million ids holds the interpreter
    lock for ~25 ms, which the server's event loop would wait out; between slices it can run."""
    out: list[int] = []
    for i in range(0, len(ids), _LIST_SLICE):
        out += ids[i : i + _LIST_SLICE].tolist()
    return out


def _serve_helper() -> None:
    import msgpack

    unpacker = msgpack.Unpacker(raw=False, max_buffer_size=1 << 30)
    tokenizers: dict[bool, Tokenizer] = {}
    while data := sys.stdin.buffer.read1(1 << 20):
        unpacker.feed(data)
        for message in unpacker:
            if not tokenizers:
                for allow_special in (False, True):
                    tokenizers[allow_special] = tok = Tokenizer.from_str(message)
                    tok.encode_special_tokens = not allow_special
                continue
            text, allow_special = message
            ids = tokenizers[allow_special].encode(text, add_special_tokens=False).ids
            sys.stdout.buffer.write(msgpack.packb(array("I", ids).tobytes(), use_bin_type=True))
            sys.stdout.buffer.flush()


def tokenizer_from_file(path: str, eos_tokens: list[str], bos_token: str | None) -> TextTokenizer:
    backend = Tokenizer.from_file(path)
    eos_ids = tuple(i for i in (backend.token_to_id(t) for t in eos_tokens) if i is not None)
    bos_id = backend.token_to_id(bos_token) if bos_token else None
    return TextTokenizer(backend, bos_token, eos_tokens[0] if eos_tokens else None, bos_id, eos_ids)


def tokenizer_from_gguf(meta: dict) -> TextTokenizer:
    """Build a byte-level BPE tokenizer from `tokenizer.ggml.*` metadata (model "gpt2").

    Raises:
        ValueError: the file's tokenizer model is not byte-level BPE.
    """
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"unsupported GGUF tokenizer model {kind!r}; only byte-level BPE ('gpt2') is supported")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre in _SPLITS:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    elif pre in _DIGIT_SPLIT:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    else:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == _CONTROL])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == _USER_DEFINED])
    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    eos_id = meta.get("tokenizer.ggml.eos_token_id")
    eos_ids = [eos_id] if eos_id is not None else []
    eot = meta.get("tokenizer.ggml.eot_token_id")
    if eot is not None and eot not in eos_ids:
        eos_ids.append(eot)
    return TextTokenizer(
        backend,
        bos_token=tokens[bos_id] if bos_id is not None else None,
        eos_token=tokens[eos_id] if eos_id is not None else None,
        bos_token_id=bos_id,
        eos_token_ids=tuple(eos_ids),
    )


if __name__ == "__main__":
    _serve_helper()
