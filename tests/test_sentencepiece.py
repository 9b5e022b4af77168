"""SentencePiece vocabularies (GGUF tokenizer model "llama", and a Hugging Face folder's tokenizer.model)
against the reference: the `sentencepiece` library itself, on a tiny Llama-2-style model trained here.

llama.cpp's rule for text around special tokens is the reference for `allow_special`: each run of text
between special tokens is encoded on its own, with its own dummy prefix (llama-vocab.cpp, SPM session).
"""

from __future__ import annotations

import re
from pathlib import Path

import gguf
import openai
import pytest

from stratum.engine.detokenizer import Detokenizer
from stratum.models.loader import load_checkpoint, read_gguf_metadata
from stratum.models.tokenizer import TextTokenizer, tokenizer_from_gguf, tokenizer_from_sentencepiece
from tests.conftest import ServerProcess
from tests.factories import add_sentencepiece_vocab, make_family_dir, make_sentencepiece_model, write_family_gguf

sentencepiece = pytest.importorskip("sentencepiece")

CORPUS = [
    "Hello world",
    " Hello world",  # a space at the start: the dummy prefix comes on top of it
    "   three spaces first, and  two   three    four inside",
    "line one\nline two\n\n\ttabbed\r\nwindows",
    "trailing spaces   ",
    "\n",
    " ",
    "",
    "digits 0123456789 and 3.14159 and 2026-12-02",
    "日本の首都は東京です。 中文 ελληνικά naïve café Straße",
    "emoji 🙂🚀 and 👩‍👩‍👧 and a lone combining mark e\u0301",
    "def add(a, b):\n    return a + b\n",
    "<s>not special</s> <|im_start|>user\nhi<|im_end|>",  # markers in user text stay plain text
    "▁already▁escaped ▁",
]
SPECIAL_TEXTS = [
    "<s>[INST] Hello [/INST]",
    "<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|><|im_end|>",
    " <|im_start|> spaced <|im_end|> ",
    "text</s>",
]


@pytest.fixture(scope="module")
def model_bytes() -> bytes:
    return make_sentencepiece_model()


@pytest.fixture(scope="module")
def sp(model_bytes):
    return sentencepiece.SentencePieceProcessor(model_proto=model_bytes)


@pytest.fixture(scope="module")
def gguf_tokenizer(model_bytes, tmp_path_factory) -> TextTokenizer:
    path = tmp_path_factory.mktemp("spm") / "vocab.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    add_sentencepiece_vocab(writer, model_bytes, vocab_size=416)  # 16 [PADn] rows, as a padded vocabulary has
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return tokenizer_from_gguf(read_gguf_metadata(gguf.GGUFReader(str(path))))


@pytest.fixture(scope="module")
def folder_tokenizer(model_bytes, tmp_path_factory) -> TextTokenizer:
    path = tmp_path_factory.mktemp("spm") / "tokenizer.model"
    path.write_bytes(model_bytes)
    return tokenizer_from_sentencepiece(str(path), ["</s>"], "<s>")


def reference_with_specials(sp, text: str) -> list[int]:
    """llama.cpp's SPM tokenization with special tokens parsed: runs of text between special tokens, each
    encoded by SentencePiece (dummy prefix included), the special tokens' ids between them."""
    specials = {sp.id_to_piece(i): i for i in range(sp.vocab_size()) if sp.is_control(i) or sp.is_unknown(i)}
    pattern = "(" + "|".join(re.escape(s) for s in sorted(specials, key=len, reverse=True)) + ")"
    ids: list[int] = []
    for part in re.split(pattern, text):
        if part in specials:
            ids.append(specials[part])
        elif part:
            ids += sp.encode(part)
    return ids


@pytest.fixture(params=["gguf", "folder"])
def tokenizer(request, gguf_tokenizer, folder_tokenizer) -> TextTokenizer:
    return gguf_tokenizer if request.param == "gguf" else folder_tokenizer


@pytest.mark.parametrize("text", CORPUS)
def test_encode_and_decode_match_sentencepiece(tokenizer, sp, text):
    ids = tokenizer.encode(text)
    assert ids == sp.encode(text), [tokenizer.backend.id_to_token(i) for i in ids]
    assert tokenizer.decode(ids) == sp.decode(ids)


def test_corpus_uses_byte_fallback_and_whitespace_pieces(sp):
    """The corpus reaches the paths under test: <0xNN> byte pieces and pieces made of spaces only."""
    pieces = {p for text in CORPUS for p in sp.encode(text, out_type=str)}
    assert any(re.fullmatch(r"<0x[0-9A-F]{2}>", p) for p in pieces)
    assert "▁▁" in pieces


@pytest.mark.parametrize("text", SPECIAL_TEXTS)
def test_special_tokens_parsed_as_llama_cpp_does(tokenizer, sp, text):
    assert tokenizer.encode(text, allow_special=True) == reference_with_specials(sp, text)
    assert tokenizer.encode(text, allow_special=False) == sp.encode(text)  # a user's text forges nothing
    ids = reference_with_specials(sp, text)
    assert tokenizer.decode(ids, skip_special_tokens=True) == sp.decode(ids)


def test_ids_and_flags(gguf_tokenizer, sp):
    assert gguf_tokenizer.bos_token == "<s>" and gguf_tokenizer.bos_token_id == sp.bos_id()
    assert gguf_tokenizer.eos_token == "</s>" and gguf_tokenizer.eos_token_ids == (sp.eos_id(),)
    assert gguf_tokenizer.vocab_size == 416
    assert gguf_tokenizer.token_bytes(sp.piece_to_id("<0x0A>")) == b"\n"
    word = next(i for i in range(sp.vocab_size()) if sp.id_to_piece(i).startswith("▁") and len(sp.id_to_piece(i)) > 2)
    assert gguf_tokenizer.token_bytes(word) == sp.id_to_piece(word).replace("▁", " ").encode()


def test_without_space_prefix(model_bytes, tmp_path):
    """add_space_prefix false (Gemma's files): no dummy prefix, as SentencePiece without add_dummy_prefix."""
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(model_bytes)
    proto.normalizer_spec.add_dummy_prefix = False
    sp = sentencepiece.SentencePieceProcessor(model_proto=proto.SerializeToString())
    path = tmp_path / "vocab.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    add_sentencepiece_vocab(writer, model_bytes, vocab_size=400, add_space_prefix=False)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tok = tokenizer_from_gguf(read_gguf_metadata(gguf.GGUFReader(str(path))))
    for text in CORPUS:
        assert tok.encode(text) == sp.encode(text), text
        assert tok.decode(sp.encode(text)) == sp.decode(sp.encode(text))


@pytest.mark.parametrize("text", CORPUS + SPECIAL_TEXTS)
def test_incremental_detokenization(gguf_tokenizer, sp, text):
    """Token by token, the released deltas add up to SentencePiece's decode of the whole."""
    ids = reference_with_specials(sp, text)
    detok = Detokenizer(gguf_tokenizer)
    out = ""
    for i in ids:
        piece = detok.add(i)
        assert "\ufffd" not in piece
        out += piece
    out += detok.flush()
    assert out == sp.decode(ids)


def test_unsupported_tokenizer_model_is_named():
    with pytest.raises(ValueError, match="'t5'"):
        tokenizer_from_gguf({"tokenizer.ggml.model": "t5", "tokenizer.ggml.tokens": ["a"]})


@pytest.mark.parametrize("source", ["gguf", "folder"])
def test_loader_reads_sentencepiece_checkpoints(source, model_bytes, sp, tmp_path, module_stratum_home):
    """A Mistral-family checkpoint with a SentencePiece vocabulary loads through the loader, as a GGUF
    (the vocabulary in its metadata) and as a Hugging Face folder with tokenizer.model only."""
    folder = make_family_dir(tmp_path / "hf", "mistral")
    (folder / "tokenizer.json").unlink()
    (folder / "tokenizer.model").write_bytes(model_bytes)
    (folder / "tokenizer_config.json").write_text('{"bos_token": "<s>", "eos_token": "</s>"}')
    path = write_family_gguf(folder, tmp_path / "m.gguf", sentencepiece=model_bytes) if source == "gguf" else folder
    for _ in range(2):  # the second GGUF load reads the converted checkpoint cache
        ck = load_checkpoint(path)
        text = CORPUS[3] + " " + CORPUS[9]
        assert ck.tokenizer.encode(text) == sp.encode(text)
        assert ck.tokenizer.eos_token_ids == (sp.eos_id(),) and ck.config.eos_token_ids == (sp.eos_id(),)



# Llama 2's chat template (meta-llama/Llama-2-7b-chat-hf tokenizer_config.json), system turn left out
LLAMA2_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
    "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
    "{{ ' ' + message['content'] + ' ' + eos_token }}{% endif %}{% endfor %}"
)
CHATML_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@pytest.mark.parametrize("template", [LLAMA2_TEMPLATE, CHATML_TEMPLATE])
def test_chat_prompt_tokenized_as_one_text(gguf_tokenizer, sp, template):
    """A rendered chat prompt gets the ids llama.cpp gives the whole rendered text: no dummy prefix where
    a user's text meets the template's text, and one BOS first (the vocabulary adds it), whether or not
    the template writes it (llama.cpp's common_chat_templates_apply drops a rendered BOS, then tokenizes
    with add_special)."""
    from stratum.models.chat_template import ChatTemplate

    assert gguf_tokenizer.add_bos
    chat = ChatTemplate(template, gguf_tokenizer)
    messages = [{"role": "user", "content": "Hello there, friend"}, {"role": "assistant", "content": "Hi 🙂"},
                {"role": "user", "content": "  two spaces\nand a line"}]
    rendered = chat.render(messages)
    assert rendered.startswith("<s>") == (template == LLAMA2_TEMPLATE)
    expected = [sp.bos_id()] + reference_with_specials(sp, rendered.removeprefix("<s>"))
    assert chat.encode(messages) == expected


# ---- BOS, as llama.cpp adds it ------------------------------------------------------------------------
def test_add_bos_read_as_llama_cpp_reads_it(gguf_tokenizer, tmp_path):
    """A GGUF's tokenizer.ggml.add_bos_token says whether prompts begin with BOS; where it is left out,
    llama.cpp's default for the vocabulary (SentencePiece and Llama 3's BPE yes, other BPE no). A
    folder's tokenizer_config.json add_bos_token says it too; left out, the tokenizer.json's
    post-processor does (Llama 3's adds <|begin_of_text|>)."""
    from tokenizers import Tokenizer, models, processors

    from stratum.models.tokenizer import tokenizer_from_file

    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["<s>", "a", "b", "ab"],
            "tokenizer.ggml.merges": ["a b"],
            "tokenizer.ggml.token_type": [3, 1, 1, 1], "tokenizer.ggml.bos_token_id": 0}
    assert not tokenizer_from_gguf({**meta, "tokenizer.ggml.pre": "smollm"}).add_bos
    assert tokenizer_from_gguf({**meta, "tokenizer.ggml.pre": "llama-bpe"}).add_bos
    assert tokenizer_from_gguf({**meta, "tokenizer.ggml.add_bos_token": True}).add_bos
    assert not tokenizer_from_gguf({**meta, "tokenizer.ggml.pre": "llama-bpe",
                                    "tokenizer.ggml.add_bos_token": False}).add_bos
    assert gguf_tokenizer.add_bos and gguf_tokenizer.encode_prompt("Hello") == [1] + gguf_tokenizer.encode("Hello")

    backend = Tokenizer(models.BPE({"<s>": 0, "a": 1}, []))
    backend.add_special_tokens(["<s>"])
    path = tmp_path / "tokenizer.json"
    for post, config, expected in [(False, None, False), (True, None, True), (True, False, False), (False, True, True)]:
        backend.post_processor = (processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
                                  if post else None)
        backend.save(str(path))
        assert tokenizer_from_file(str(path), [], "<s>", config).add_bos == expected


MISTRAL_V3 = (Path(__file__).parent / "data" / "chat_templates" / "mistral-v3.jinja").read_text()


@pytest.fixture(scope="module")
def spm_server(model_bytes, tmp_path_factory, module_stratum_home):
    """The tiny model as a SentencePiece GGUF (add_bos_token true) with Mistral v3's template, which writes BOS."""
    root = tmp_path_factory.mktemp("bos")
    folder = make_family_dir(root / "hf", "mistral", max_position_embeddings=1024)
    path = write_family_gguf(folder, root / "m.gguf", sentencepiece=model_bytes, chat_template=MISTRAL_V3)
    server = ServerProcess(str(path), "--served-model-name", "tiny", "--kv-cache-mb", "8").wait_ready()
    yield server
    server.stop()


def test_bos_added_once_as_llama_server_does(spm_server, sp):
    """/v1/completions begins a text prompt with BOS (a token-id prompt is taken as it is), and an echo's
    offsets stay on the text; a chat prompt has one BOS, though Mistral's template writes one too."""
    oai = openai.OpenAI(base_url=spm_server.url + "/v1", api_key="test", max_retries=0)
    text = "Hello world"
    r = oai.completions.create(model="tiny", prompt=text, max_tokens=1, echo=True, logprobs=0, temperature=0)
    assert r.usage.prompt_tokens == 1 + len(sp.encode(text))
    logprobs = r.choices[0].logprobs
    assert logprobs.tokens[0] == "<s>" and logprobs.token_logprobs[0] is None
    assert r.choices[0].text.startswith(text) and logprobs.text_offset[:2] == [0, 0]
    assert (oai.completions.create(model="tiny", prompt=sp.encode(text), max_tokens=1).usage.prompt_tokens
            == len(sp.encode(text)))

    messages = [{"role": "user", "content": "Hello there"}]
    rendered = "[INST] Hello there[/INST]"  # Mistral v3's template after its BOS
    expected = [sp.bos_id()] + reference_with_specials(sp, rendered)
    r = oai.chat.completions.create(model="tiny", messages=messages, max_tokens=1)
    assert r.usage.prompt_tokens == len(expected)
