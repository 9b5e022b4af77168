"""Tokenizers: Hugging Face `tokenizers` built from tokenizer.json, a SentencePiece tokenizer.model, or a
GGUF vocabulary (byte-level BPE "gpt2", or SentencePiece "llama").

Text that comes from a user (message content, tool output) is always encoded with special tokens
disabled, so "<|im_start|>" typed by a user is plain text and cannot forge a chat turn.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import subprocess
import sys
import threading
from array import array
from dataclasses import dataclass, field

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

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

# llama.cpp token types (gguf.TokenType), the same numbers as SentencePiece's piece types
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6
_SPIECE_SPACE = "\u2581"  # SentencePiece's stand-in for a space
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")

log = logging.getLogger("stratum.tokenizer")


@dataclass
class TextTokenizer:
    """A `tokenizers.Tokenizer` plus the ids a serving runtime needs. Safe to use from several threads."""

    backend: Tokenizer
    bos_token: str | None = None
    eos_token: str | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # a prompt begins with BOS (the GGUF's tokenizer.ggml.add_bos_token, or the folder's add_bos_token)
    add_bos: bool = False
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

    def encode_prompt(self, text: str) -> list[int]:
        """A whole prompt's ids (a raw completions prompt): BOS first where the model's tokenizer adds it,
        as llama-server does, then the text with special-token strings as plain text."""
        return self.with_bos(self.encode(text))

    def with_bos(self, ids: list[int]) -> list[int]:
        """ids beginning with one BOS where the tokenizer adds it (none added where they already begin with it)."""
        if self.add_bos and self.bos_token_id is not None and ids[:1] != [self.bos_token_id]:
            return [self.bos_token_id, *ids]
        return ids

    def split_special(self, text: str) -> list[tuple[str, int | None]]:
        """Text cut after each added token (special or not): [(text before it, its id)], then (the rest, None)."""
        enc = self.backend.encode_batch([text], add_special_tokens=False)[0]
        out, start = [], 0
        for token_id, (begin, end) in zip(enc.ids, enc.offsets):
            if token_id in self._special_ids:
                out.append((text[start:begin], token_id))
                start = end
        out.append((text[start:], None))
        return out

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def special_token_id(self, token: str) -> int | None:
        """The id of `token` if it is a special token (read in templates, never in user text), else None."""
        return self._special_by_text.get(token)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (a byte-level BPE token may hold part of a UTF-8 character)."""
        piece = self.backend.id_to_token(token_id)
        if piece is None:
            return b""
        if token_id in self._special_ids:
            return piece.encode()
        if not isinstance(self.backend.decoder, decoders.ByteLevel):  # SentencePiece: "▁" spaces, <0xNN> bytes
            byte = _BYTE_PIECE.fullmatch(piece)
            return bytes([int(byte.group(1), 16)]) if byte else piece.replace(_SPIECE_SPACE, " ").encode()
        table = byte_decoder()
        if all(ch in table for ch in piece):
            return bytes(table[ch] for ch in piece)
        return self.backend.decode([token_id], skip_special_tokens=False).encode()

    @functools.cached_property
    def _special_ids(self) -> set[int]:
        return set(self.backend.get_added_tokens_decoder())

    @functools.cached_property
    def _special_by_text(self) -> dict[str, int]:
        return {t.content: i for i, t in self.backend.get_added_tokens_decoder().items() if t.special}


@functools.cache
def byte_decoder() -> dict[str, int]:
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


def tokenizer_from_file(path: str, eos_tokens: list[str], bos_token: str | None,
                        add_bos: bool | None = None) -> TextTokenizer:
    """A tokenizer.json; add_bos as the folder's tokenizer_config.json says, else as the file's post-processor
    does (Llama 3's adds <|begin_of_text|>)."""
    backend = Tokenizer.from_file(path)
    eos_ids = tuple(i for i in (backend.token_to_id(t) for t in eos_tokens) if i is not None)
    bos_id = backend.token_to_id(bos_token) if bos_token else None
    if add_bos is None:
        add_bos = bos_id is not None and backend.encode("a", add_special_tokens=True).ids[:1] == [bos_id]
    return TextTokenizer(backend, bos_token, eos_tokens[0] if eos_tokens else None, bos_id, eos_ids, add_bos)


def tokenizer_from_gguf(meta: dict) -> TextTokenizer:
    """Build the tokenizer a GGUF's `tokenizer.ggml.*` metadata describes: byte-level BPE (model "gpt2") or
    SentencePiece (model "llama", the vocabulary of Llama 2, Mistral, Gemma and Phi-3 files).

    Raises:
        ValueError: the file's tokenizer model is neither.
    """
    kind = meta.get("tokenizer.ggml.model")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types = meta.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
    if kind == "gpt2":
        backend = _byte_level_bpe(tokens, meta["tokenizer.ggml.merges"], meta.get("tokenizer.ggml.pre", "default"))
    elif kind == "llama":
        scores = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
        # llama.cpp's defaults when a file leaves these out (llama-vocab.cpp, LLAMA_VOCAB_TYPE_SPM)
        backend = _sentencepiece(list(zip(tokens, scores, types)), is_bpe=True,
                                 unk_id=meta.get("tokenizer.ggml.unknown_token_id", 0),
                                 add_space_prefix=meta.get("tokenizer.ggml.add_space_prefix", True))
    else:
        raise ValueError(f"unsupported GGUF tokenizer model {kind!r}; supported: 'gpt2' (byte-level BPE), "
                         "'llama' (SentencePiece)")
    _add_special_tokens(backend, tokens, types)
    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    eos_id = meta.get("tokenizer.ggml.eos_token_id")
    eos_ids = [eos_id] if eos_id is not None else []
    eot = meta.get("tokenizer.ggml.eot_token_id")
    if eot is not None and eot not in eos_ids:
        eos_ids.append(eot)
    # llama.cpp's default where the file does not say (llama-vocab.cpp): SentencePiece and Llama 3's
    # byte-level BPE add BOS, other byte-level BPE vocabularies do not
    add_bos = meta.get("tokenizer.ggml.add_bos_token",
                       kind == "llama" or meta.get("tokenizer.ggml.pre") in ("llama3", "llama-v3", "llama-bpe"))
    return TextTokenizer(
        backend,
        bos_token=tokens[bos_id] if bos_id is not None else None,
        eos_token=tokens[eos_id] if eos_id is not None else None,
        bos_token_id=bos_id,
        eos_token_ids=tuple(eos_ids),
        add_bos=bool(add_bos) and bos_id is not None,
    )


def tokenizer_from_sentencepiece(path: str, eos_tokens: list[str], bos_token: str | None,
                                 add_bos: bool = True) -> TextTokenizer:
    """A Hugging Face folder's SentencePiece `tokenizer.model` (a folder without tokenizer.json), built as
    `tokenizer_from_gguf` builds a "llama" vocabulary. Needs the `sentencepiece` package to read the file.

    Raises:
        ValueError: the package is missing, or the file is not a SentencePiece model of a kind read here.
    """
    try:
        from sentencepiece import sentencepiece_model_pb2
    except ImportError as e:
        raise ValueError(f"reading {path} needs the sentencepiece package ({e})") from e
    proto = sentencepiece_model_pb2.ModelProto()
    try:
        with open(path, "rb") as f:
            proto.ParseFromString(f.read())
    except Exception as e:  # protobuf's DecodeError, whose class depends on the protobuf build
        raise ValueError(f"{path}: not a SentencePiece model ({e})") from e
    model_type = proto.trainer_spec.model_type  # 1 unigram, 2 BPE (word and char models are not read)
    if model_type not in (1, 2):
        raise ValueError(f"{path}: SentencePiece model type {model_type} is not supported (unigram or BPE)")
    pieces = [(p.piece, p.score, p.type) for p in proto.pieces]
    backend = _sentencepiece(pieces, is_bpe=model_type == 2, unk_id=proto.trainer_spec.unk_id,
                             add_space_prefix=proto.normalizer_spec.add_dummy_prefix,
                             charsmap=proto.normalizer_spec.precompiled_charsmap)
    _add_special_tokens(backend, [p for p, _, _ in pieces], [t for _, _, t in pieces])
    eos_ids = tuple(i for i in (backend.token_to_id(t) for t in eos_tokens) if i is not None)
    bos_id = backend.token_to_id(bos_token) if bos_token else None
    return TextTokenizer(backend, bos_token, eos_tokens[0] if eos_tokens else None, bos_id, eos_ids,
                         add_bos and bos_id is not None)


def _byte_level_bpe(tokens: list[str], merges: list[str], pre: str) -> Tokenizer:
    vocab = {tok: i for i, tok in enumerate(tokens)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges], fuse_unk=False))
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
    return backend


def _sentencepiece(pieces: list[tuple[str, float, int]], is_bpe: bool, unk_id: int, add_space_prefix: bool,
                   charsmap: bytes = b"") -> Tokenizer:
    """A SentencePiece vocabulary as a `tokenizers.Tokenizer`, the way transformers' convert_slow_tokenizer
    builds Llama's (LlamaConverter, legacy form): spaces become "▁", one "▁" is prepended to each run of
    text between special tokens when add_space_prefix (as SentencePiece's dummy prefix, and llama.cpp
    after each special token), characters outside the vocabulary fall back to <0xNN> byte pieces.

    A BPE model merges the adjacent pair whose merged piece scores highest, as SentencePiece and
    llama.cpp's SPM tokenizer do: that is BPE with merges ranked by the merged piece's score
    (transformers' generate_merges). A unigram model takes the (piece, score) pairs as they are.
    """
    if is_bpe:
        vocab = {p: i for i, (p, _, _) in enumerate(pieces)}
        # only pieces SentencePiece itself can produce from text take part in merges
        mergeable = {p for p, _, t in pieces if t in (_NORMAL, _USER_DEFINED)}
        ranked = []
        for piece, score, kind in pieces:
            if kind != _NORMAL:
                continue
            local = [(piece[:k], piece[k:]) for k in range(1, len(piece))
                     if piece[:k] in mergeable and piece[k:] in mergeable]
            local.sort(key=lambda lr: (vocab[lr[0]], vocab[lr[1]]))
            ranked += [(score, left, right) for left, right in local]
        ranked.sort(key=lambda m: (m[0], len(m[1]), len(m[2])), reverse=True)  # stable: ties keep vocab order
        model = models.BPE(vocab=vocab, merges=[(left, right) for _, left, right in ranked],
                           unk_token=pieces[unk_id][0], fuse_unk=True, byte_fallback=True)
    else:
        model = models.Unigram([(p, s) for p, s, _ in pieces], unk_id=unk_id, byte_fallback=True)
    backend = Tokenizer(model)
    steps = [normalizers.Precompiled(charsmap)] if charsmap else []
    if add_space_prefix:
        steps.append(normalizers.Prepend(_SPIECE_SPACE))
    backend.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", _SPIECE_SPACE)])
    steps = [decoders.Replace(_SPIECE_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:  # the dummy prefix of the first piece is not text
        steps.append(decoders.Strip(content=" ", left=1))
    backend.decoder = decoders.Sequence(steps)
    return backend


def _add_special_tokens(backend: Tokenizer, tokens: list[str], types: list[int]) -> None:
    """Control and unknown tokens become special tokens (matched in templates, plain text in user text);
    user-defined ones are matched in any text, as llama.cpp and SentencePiece do."""
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, k in zip(tokens, types) if k in (_CONTROL, _UNKNOWN)])
    backend.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, k in zip(tokens, types) if k == _USER_DEFINED])


if __name__ == "__main__":
    _serve_helper()
