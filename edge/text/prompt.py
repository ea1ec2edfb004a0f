"""The prompt a question and its documents become: the model's own chat template
(ChatML where it has none), tokenized, with the reusable prefix marked.

Control tokens (the tokenizer's special tokens: `<|im_start|>`, `<|eot_id|>`, `<s>`...)
come only from the template. Message text, the question, the documents and the system
prompt alike, is always tokenized as text: a document that contains `<|im_start|>` gets
the ordinary pieces of those characters, never the token that opens a turn (otherwise a
planted document could write a turn of its own and the model would read it as the
conversation). The template is rendered with each control token inside the text held
out as a placeholder; the rendered prompt is then cut at the template's control tokens,
each becoming its id, and every stretch between them encoded with special-token parsing
off, the placeholders given back their characters first. Cutting at the control tokens
is what the tokenizer itself does when it parses them (it tokenizes the stretches between
them one by one), so a prompt without such text tokenizes exactly as before.
"""

from __future__ import annotations

import re
import secrets
from typing import Any

from tokenizers import Tokenizer

from edge.text.model.chat import ChatTemplate


def chatml(system: str, user: str) -> str:
    """The ChatML turn layout SmolLM2-Instruct was tuned on, ready for the answer."""
    return f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


def user_message(question: str, context: str | None) -> str:
    if not context:
        return question
    return f"Context:\n{context.strip()}\n\nQuestion: {question.strip()}"


def control_tokens(tokenizer: Tokenizer) -> dict[str, int]:
    """The tokenizer's special tokens by their text: what only a template may write."""
    return {tok.content: i for i, tok in tokenizer.get_added_tokens_decoder().items() if tok.special}


class _Held:
    """Control-token text taken out of message text for one rendering: each occurrence
    becomes a placeholder (private-use characters around a random nonce, which no text
    holds and no template filter changes), given back as text when the prompt is encoded."""

    def __init__(self, controls: re.Pattern[str] | None) -> None:
        self._controls = controls
        self.nonce = secrets.token_hex(8)
        self.pattern = re.compile(f"\ue000{self.nonce}:(\\d+)\ue001")
        self.originals: list[str] = []

    def __call__(self, text: str) -> str:
        if self._controls is None:
            return text
        return self._controls.sub(self._hold, text)

    def _hold(self, match: re.Match[str]) -> str:
        self.originals.append(match.group(0))
        return f"\ue000{self.nonce}:{len(self.originals) - 1}\ue001"

    def give_back(self, text: str) -> str:
        return self.pattern.sub(lambda m: self.originals[int(m.group(1))], text)


class Prompter:
    """Turns (question, context) into prompt tokens for one model. A template that
    refuses the conversation raises chat.ChatTemplateError; the task says which field."""

    def __init__(
        self, tokenizer: Tokenizer, chat: ChatTemplate | None, system_prompt: str, typed_parts: bool = False
    ) -> None:
        """`typed_parts`: every message's content a list of typed parts, with or without
        an image, as a vision-language model's template reads it (LLaVA's writes only
        the text parts of a message: plain text content would vanish from its prompt)."""
        self.tokenizer = tokenizer
        self.chat = chat
        self.system_prompt = system_prompt
        self.typed_parts = typed_parts
        self._ids = control_tokens(tokenizer)
        # Longest first, so that a control token that begins another is never cut short.
        names = sorted(self._ids, key=len, reverse=True)
        self._controls = re.compile("|".join(map(re.escape, names))) if names else None
        # The same tokenizer with special-token parsing off: for message text.
        self._text = Tokenizer.from_str(tokenizer.to_str())
        self._text.encode_special_tokens = True

    def _render(self, system: str, user: str, images: int = 0) -> str:
        if self.chat is None:
            if images:
                raise ValueError(
                    "a prompt with an image needs the model's own chat template (ChatML has no image token)"
                )
            return chatml(system, user)
        messages: list[dict[str, Any]]
        if images or self.typed_parts:
            # A conversation with images as transformers' processors take one: each
            # message's content a list of typed parts, the images before the user's text;
            # the template writes each image's token (a control token, never message text).
            messages = [
                {"role": "system", "content": [{"type": "text", "text": system}]},
                {"role": "user", "content": [*[{"type": "image"}] * images, {"type": "text", "text": user}]},
            ]
        else:
            messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        return self.chat.render(messages, add_generation_prompt=True)

    def text(self, question: str, context: str | None, images: int = 0) -> str:
        """The prompt as text (control tokens in message text look the same as the
        template's here: `ids` and `parts` tell them apart)."""
        return self._render(self.system_prompt, user_message(question, context), images)

    def ids(self, question: str, context: str | None, images: int = 0) -> list[int]:
        return self.parts(question, context, images)[0]

    def _encode(self, rendered: str, held: _Held) -> list[int]:
        """Token ids of a rendering: its control tokens (the template's own, since every
        one in message text is held out) as their ids, the rest as text."""
        ids: list[int] = []
        at = 0
        matches = self._controls.finditer(rendered) if self._controls is not None else iter(())
        for match in matches:
            if match.start() > at:
                ids += self._text.encode(held.give_back(rendered[at : match.start()]), add_special_tokens=False).ids
            ids.append(self._ids[match.group(0)])
            at = match.end()
        if at < len(rendered):
            ids += self._text.encode(held.give_back(rendered[at:]), add_special_tokens=False).ids
        return ids

    def parts(self, question: str, context: str | None, images: int = 0) -> tuple[list[int], int]:
        """The prompt's tokens, and how many of the first are its reusable prefix: the
        system turn and the context documents, up to the question (the prefix cache's
        key). The prefix is where the prompt's tokens and the prefix text's own agree,
        less one token (the one a different question could merge with). `images`: image
        parts the user's turn opens with, each written by the template as its image token
        (edge/vlm expands it into the image's rows)."""
        held = _Held(self._controls)
        escaped_question = held(question)
        escaped_context = held(context) if context else context
        # The template writes the special tokens (a BOS among them) itself, as in transformers.
        text = self._render(held(self.system_prompt), user_message(escaped_question, escaped_context), images)
        ids = self._encode(text, held)
        marker = "Question: " if context else escaped_question
        cut = text.rfind(marker)
        if cut <= 0:
            return ids, 0
        head = self._encode(text[:cut], held)
        same = 0
        for a, b in zip(ids, head, strict=False):
            if a != b:
                break
            same += 1
        return ids, max(0, same - 1)
