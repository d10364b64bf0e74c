"""A tokenizer for the fake model: one token per character, no torch, no files."""

from __future__ import annotations

OFFSET = 4  # ids 0-3 are special; 3 is EOS


class FakeTokenizer:
    eos_token_ids = (3,)
    vocab_size = 97

    def encode(self, text: str) -> list[int]:
        return [OFFSET + ord(c) % (self.vocab_size - OFFSET) for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(32 + (i - OFFSET) % 90) for i in ids
                       if not (skip_special_tokens and i < OFFSET))

    def apply_chat_template(self, messages: list[dict[str, str]],
                            add_generation_prompt: bool = True) -> list[int]:
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        if add_generation_prompt:
            text += "<assistant>"
        return self.encode(text)
