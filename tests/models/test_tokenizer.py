"""Tokenizer: the same ids, text and chat prompts as transformers gives."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

from mpexec.models.loader import checkpoint_tokenizer, open_checkpoint
from mpexec.models.testing import write_tiny_checkpoint
from mpexec.models.testing_gguf import write_tiny_gguf
from mpexec.models.tokenizer import IncrementalDecoder, Tokenizer

FRAGMENTS = [
    "Hello", " world", "the quick brown fox", "12345", " 2024-01-01", "3.14159", "x=42;",
    "héllo", "naïve café", "日本語のテキスト", "中文", "😀🎉", "👩‍👩‍👧", "e\u0301", "Ωμέγα",
    "   ", "\t\t", "\n", "\n\n\n", "\r\n", "\u00a0", "  trailing  ", "it's", " we'll", "I'M",
    "don't", "!!!", "...", "?!", "def f(x):\n    return x**2", "<|im_start|>", "<|im_end|>",
    "<s>", "</s>", "<|endoftext|>", "user", "assistant", "a" * 40, "ÿ", "\x00", "~`^",
    "https://example.com/a?b=c", "snake_case_name", "CamelCaseName", "1,000,000", "-5",
]


def sample_strings(count: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    strings = [*FRAGMENTS, "", " ", "  ", "a", " a", "a "]
    while len(strings) < count:
        strings.append("".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(2, 6))))
    return strings


MESSAGES = [
    [{"role": "user", "content": "Hi there"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}],
    [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi! 😀"},
     {"role": "user", "content": "日本語で話して\nplease"}],
]


def check_against(mine: Tokenizer, oracle, strings: list[str]) -> None:  # type: ignore[no-untyped-def]
    for text in strings:
        ids = mine.encode(text)
        assert ids == oracle.encode(text), repr(text)
        assert mine.decode(ids) == oracle.decode(ids, skip_special_tokens=True), repr(text)
        assert (mine.decode(ids, skip_special_tokens=False)
                == oracle.decode(ids, skip_special_tokens=False)), repr(text)
    for messages in MESSAGES:
        for generation in (True, False):
            text = oracle.apply_chat_template(messages, tokenize=False,
                                              add_generation_prompt=generation)
            assert mine.chat_prompt(messages, add_generation_prompt=generation) == text
            ids = oracle.apply_chat_template(messages, tokenize=True,
                                             add_generation_prompt=generation)
            ids = list(ids["input_ids"]) if hasattr(ids, "keys") else list(ids)
            assert mine.apply_chat_template(messages, add_generation_prompt=generation) == ids


def import_oracle():  # type: ignore[no-untyped-def]
    """transformers, in the torch-marked runs only: that is the setup it is checked in."""
    pytest.importorskip("torch")
    return pytest.importorskip("transformers")


@pytest.mark.torch
@pytest.mark.parametrize("add_bos", [False, True])
def test_hf_directory_matches_transformers(tmp_path: Path, add_bos: bool) -> None:
    transformers = import_oracle()
    directory = write_tiny_checkpoint(tmp_path / "t", add_bos_token=add_bos, num_hidden_layers=1)
    mine = open_checkpoint(directory).tokenizer()
    oracle = transformers.AutoTokenizer.from_pretrained(str(directory))
    assert (mine.encode("hi")[:1] == [mine.bos_token_id]) is add_bos
    check_against(mine, oracle, sample_strings(300))
    assert mine.eos_token_ids == (1, 3)
    assert mine.vocab_size == len(oracle)


@pytest.mark.torch
def test_bos_follows_the_post_processor_like_transformers(tmp_path: Path) -> None:
    """add_bos_token in tokenizer_config.json alone adds nothing, in transformers either."""
    import json

    transformers = import_oracle()
    directory = write_tiny_checkpoint(tmp_path / "t", num_hidden_layers=1)
    settings = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps({**settings,
                                                                 "add_bos_token": True}))
    oracle = transformers.AutoTokenizer.from_pretrained(str(directory))
    mine = Tokenizer.from_hf_dir(directory)
    assert mine.encode("hello there") == oracle.encode("hello there")


def test_checkpoint_tokenizer_from_a_config_read_before(tmp_path: Path) -> None:
    """The tokenizer alone, given the config: the same as the checkpoint's own."""
    pytest.importorskip("gguf")
    directory = write_tiny_checkpoint(tmp_path / "t", hidden_size=288, intermediate_size=224,
                                      num_hidden_layers=1)
    gguf_path = write_tiny_gguf(tmp_path / "t.gguf", directory)
    texts = sample_strings(50, seed=2)
    for path in (directory, gguf_path):
        with open_checkpoint(path) as checkpoint:
            config, whole = checkpoint.config, checkpoint.tokenizer()
        alone = checkpoint_tokenizer(path, config)
        assert [alone.encode(t) for t in texts] == [whole.encode(t) for t in texts]
        assert alone.eos_token_ids == whole.eos_token_ids
        assert alone.apply_chat_template(MESSAGES[0]) == whole.apply_chat_template(MESSAGES[0])


def test_gguf_tokenizer_equals_the_directory_it_came_from(tmp_path: Path) -> None:
    pytest.importorskip("gguf")
    directory = write_tiny_checkpoint(tmp_path / "t", hidden_size=288, intermediate_size=224,
                                      num_hidden_layers=1)
    from_dir = open_checkpoint(directory).tokenizer()
    from_gguf = open_checkpoint(write_tiny_gguf(tmp_path / "t.gguf", directory)).tokenizer()
    for text in sample_strings(300, seed=1):
        assert from_gguf.encode(text) == from_dir.encode(text), repr(text)
    for messages in MESSAGES:
        assert from_gguf.apply_chat_template(messages) == from_dir.apply_chat_template(messages)


@pytest.mark.slow
@pytest.mark.torch
@pytest.mark.timeout(300)
def test_smollm2_matches_transformers(smollm2_gguf: Path) -> None:
    transformers = import_oracle()
    pytest.importorskip("gguf")
    with open_checkpoint(smollm2_gguf) as ckpt:
        mine = ckpt.tokenizer()
    oracle = transformers.AutoTokenizer.from_pretrained(str(smollm2_gguf.parent),
                                                        gguf_file=smollm2_gguf.name)
    check_against(mine, oracle, sample_strings(400, seed=2))
    assert mine.bos_token_id == 1 and mine.eos_token_ids == (2,)
    assert mine.encode("Hello")[0] != mine.bos_token_id  # SmolLM2 adds no BOS
    assert mine.vocab_size == 49152
    text = "naïve 日本語 😀🎉 👩‍👩‍👧 done"
    ids = mine.encode(text)
    decoder = IncrementalDecoder(mine)
    pieces = [decoder.push(i) for i in ids] + [decoder.flush()]
    assert "".join(pieces) == text and not any("\ufffd" in p for p in pieces)
    prompt = mine.chat_prompt([{"role": "user", "content": "Hi"}])
    assert prompt.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert prompt.endswith("<|im_start|>assistant\n")


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    directory = write_tiny_checkpoint(tmp_path_factory.mktemp("tok") / "t", num_hidden_layers=1)
    return open_checkpoint(directory).tokenizer()


@pytest.mark.parametrize("text", ["héllo wörld 日本語 😀🎉 👩‍👩‍👧 done", "plain ascii text",
                                  "<|im_end|>after special", "\n\n  spaced\t out  "])
def test_incremental_decoder_streams_whole_characters(tiny_tokenizer: Tokenizer,
                                                      text: str) -> None:
    ids = tiny_tokenizer.encode(text)
    decoder = IncrementalDecoder(tiny_tokenizer)
    pieces = [decoder.push(i) for i in ids]
    pieces.append(decoder.flush())
    assert "".join(pieces) == tiny_tokenizer.decode(ids)
    assert not any("\ufffd" in piece for piece in pieces)
    if "😀" in text:  # a 4-byte character is several byte tokens: held, then emitted whole
        assert "" in pieces


def test_incremental_decoder_flushes_an_unfinished_character(tiny_tokenizer: Tokenizer) -> None:
    ids = tiny_tokenizer.encode("ok 😀")
    decoder = IncrementalDecoder(tiny_tokenizer)
    text = decoder.extend(ids[:-1])
    assert text == "ok "
    assert decoder.flush() == "\ufffd"


def test_chat_template_is_sandboxed(tiny_tokenizer: Tokenizer) -> None:
    import jinja2
    from jinja2.sandbox import SecurityError

    unsafe = Tokenizer(tiny_tokenizer.backend, bos_token_id=0, eos_token_ids=(1,),
                       chat_template="{{ ''.__class__.__mro__[1].__subclasses__() }}",
                       special_tokens={})
    with pytest.raises(SecurityError):
        unsafe.chat_prompt([])
    refusing = Tokenizer(tiny_tokenizer.backend, bos_token_id=0, eos_token_ids=(1,),
                         chat_template="{{ raise_exception('no system role') }}",
                         special_tokens={})
    with pytest.raises(jinja2.TemplateError, match="no system role"):
        refusing.chat_prompt([{"role": "system", "content": "x"}])
    bare = Tokenizer(tiny_tokenizer.backend, bos_token_id=0, eos_token_ids=(1,),
                     chat_template=None, special_tokens={}, source="here")
    with pytest.raises(ValueError, match="no chat template"):
        bare.chat_prompt([])


def test_checkpoints_and_tokenizers_open_without_torch(tiny_checkpoint: Path,
                                                       tmp_path: Path) -> None:
    """The driver side (config, names, shapes, tokenizer) needs no torch."""
    from tests.python_child import run_python

    pytest.importorskip("gguf")
    gguf_path = write_tiny_gguf(tmp_path / "t.gguf", tiny_checkpoint, qtype="F32")
    child = f"""
import sys

class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is blocked in this test")

sys.meta_path.insert(0, NoTorch())
from mpexec.models.loader import open_checkpoint
for path in ({str(tiny_checkpoint)!r}, {str(gguf_path)!r}):
    with open_checkpoint(path) as ckpt:
        print(ckpt.config.num_hidden_layers, len(ckpt.names()),
              ckpt.tokenizer().encode("hello world"))
assert "torch" not in sys.modules
"""
    done = run_python("-c", child)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 2 and lines[0] == lines[1]


# ── SentencePiece-style vocabularies in GGUF (tokenizer.ggml.model = llama) ──

SPM_EXTRA = ["<0x41>", "▁hello", "hello▁", "tab\there", " x", "  x", "x  ", "   ",
             "\u2581", "ab\u2581cd", "<unk>", "<|im_start|>user\nhi<|im_end|>"]


def write_spm_gguf(path: Path, arch: str, **flags: bool) -> Path:
    import gguf

    from mpexec.models.testing_gguf import add_spm_tokenizer

    writer = gguf.GGUFWriter(str(path), arch)
    add_spm_tokenizer(writer, 389, space_tokens=arch.startswith("gemma"), **flags)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.torch
@pytest.mark.parametrize(("arch", "flags"), [
    ("llama", {"add_bos": True}), ("llama", {"add_bos": False, "add_eos": True}),
    ("gemma3", {"add_bos": True}), ("gemma2", {"add_bos": False}),
    ("phi3", {"add_bos": True, "add_eos": False}),
])
def test_sentencepiece_gguf_matches_transformers(tmp_path: Path, arch: str,
                                                 flags: dict[str, bool]) -> None:
    transformers = import_oracle()
    pytest.importorskip("gguf")
    from mpexec.models.loader.gguf_header import read_header
    from mpexec.models.loader.gguf_tokenizer import build_backend

    path = write_spm_gguf(tmp_path / "spm.gguf", arch, **flags)
    mine = build_backend(read_header(path).fields, path)
    oracle = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    fallback = 0
    for text in [*sample_strings(300, seed=3), *SPM_EXTRA]:
        ids = mine.encode(text).ids
        assert ids == oracle.encode(text), repr(text)
        fallback += sum(5 <= i < 5 + 256 for i in ids)
        for skip in (True, False):
            assert (mine.decode(ids, skip_special_tokens=skip)
                    == oracle.decode(ids, skip_special_tokens=skip)), repr(text)
    assert fallback > 100  # the unicode strings went through <0xNN> byte tokens
    assert (mine.encode("hi").ids[0] == 0) is flags["add_bos"]
    assert (mine.encode("hi").ids[-1] == 3) is bool(flags.get("add_eos"))


@pytest.mark.torch
def test_sentencepiece_gguf_checkpoint_tokenizer(tmp_path: Path) -> None:
    transformers = import_oracle()
    pytest.importorskip("gguf")
    directory = write_tiny_checkpoint(tmp_path / "t", hidden_size=288, intermediate_size=224,
                                      num_hidden_layers=1, add_bos_token=True)
    path = write_tiny_gguf(tmp_path / "t.gguf", directory, tokenizer="llama")
    mine = open_checkpoint(path).tokenizer()
    oracle = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    check_against(mine, oracle, sample_strings(200, seed=4))
    text = "naïve 日本語 😀🎉 done"
    ids = mine.encode(text)
    assert any(5 <= i < 261 for i in ids)  # byte fallback
    decoder = IncrementalDecoder(mine)
    pieces = [decoder.push(i) for i in ids] + [decoder.flush()]
    assert "".join(pieces) == text and not any("\ufffd" in p for p in pieces)


@pytest.mark.slow
@pytest.mark.torch
@pytest.mark.timeout(900)
def test_gemma3_270m_matches_transformers() -> None:
    """Gemma 3's 262,144-token SentencePiece vocabulary, from the real GGUF."""
    transformers = import_oracle()
    pytest.importorskip("gguf")
    from mpexec.models import fetch

    path = fetch.cached_model("gemma3-270m")
    if path is None:
        pytest.skip("gemma3-270m is not in the cache (resolve_model('gemma3-270m') fetches it)")
    from mpexec.models.loader.gguf_header import read_header
    from mpexec.models.loader.gguf_tokenizer import build_backend

    mine = build_backend(read_header(path).fields, path)
    oracle = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    strings = [*sample_strings(400, seed=2), " leading", "  two", "a  b   c",
               "<start_of_turn>user\nhi<end_of_turn>\n"]
    for text in strings:
        ids = mine.encode(text).ids
        assert ids == oracle.encode(text), repr(text)
        for skip in (True, False):
            assert (mine.decode(ids, skip_special_tokens=skip)
                    == oracle.decode(ids, skip_special_tokens=skip)), repr(text)
    assert mine.encode("Hi").ids[0] == 2  # <bos>
