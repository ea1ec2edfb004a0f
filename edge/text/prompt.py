"""The prompt a question and its documents become: the model's own chat template
(ChatML where it has none), tokenized, with the reusable prefix marked."""

from __future__ import annotations

from tokenizers import Tokenizer

from edge.text.model.chat import ChatTemplate


def chatml(system: str, user: str) -> str:
    """The ChatML turn layout SmolLM2-Instruct was tuned on, ready for the answer."""
    return f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


def user_message(question: str, context: str | None) -> str:
    if not context:
        return question
    return f"Context:\n{context.strip()}\n\nQuestion: {question.strip()}"


class Prompter:
    """Turns (question, context) into prompt tokens for one model. A template that
    refuses the conversation raises chat.ChatTemplateError; the task says which field."""

    def __init__(self, tokenizer: Tokenizer, chat: ChatTemplate | None, system_prompt: str) -> None:
        self.tokenizer = tokenizer
        self.chat = chat
        self.system_prompt = system_prompt

    def text(self, question: str, context: str | None) -> str:
        system, user = self.system_prompt, user_message(question, context)
        if self.chat is None:
            return chatml(system, user)
        messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        return self.chat.render(messages, add_generation_prompt=True)

    def ids(self, question: str, context: str | None) -> list[int]:
        return self.parts(question, context)[0]

    def parts(self, question: str, context: str | None) -> tuple[list[int], int]:
        """The prompt's tokens, and how many of the first are its reusable prefix: the
        system turn and the context documents, up to the question (the prefix cache's
        key). The prefix is where the prompt's tokens and the prefix text's own agree,
        less one token (the one a different question could merge with)."""
        # The template writes the special tokens (a BOS among them) itself, as in transformers.
        text = self.text(question, context)
        encode = self.tokenizer.encode
        ids = list(encode(text, add_special_tokens=False).ids)
        marker = "Question: " if context else question
        cut = text.rfind(marker)
        if cut <= 0:
            return ids, 0
        head = encode(text[:cut], add_special_tokens=False).ids
        same = 0
        for a, b in zip(ids, head, strict=False):
            if a != b:
                break
            same += 1
        return ids, max(0, same - 1)
