"""Problem text -> prompt token ids: the tokenizer's chat template, or plain text."""

from __future__ import annotations

from rlscale.errors import UserError


class PromptRenderer:
    def __init__(self, tokenizer, prompt_format: str = "auto", max_prompt_tokens: int | None = None):
        has_template = bool(getattr(tokenizer, "chat_template", None))
        if prompt_format == "chat" and not has_template:
            raise UserError("policy.prompt_format: 'chat' was asked for but the tokenizer has no chat template")
        self.tokenizer = tokenizer
        self.use_chat = prompt_format == "chat" or (prompt_format == "auto" and has_template)
        self.max_prompt_tokens = max_prompt_tokens

    def render_all(self, texts: list[str]) -> tuple[list[list[int]], list[bool]]:
        """`render` of each text, and whether each was cut to max_prompt_tokens; a GRPO batch
        repeats every prompt once per sample, so each distinct text is rendered once (a chat
        template costs ~0.1 ms per call)."""
        rendered: dict[str, tuple[list[int], bool]] = {}
        for text in texts:
            if text not in rendered:
                ids = self.render_whole(text)
                fitted = self.fit(ids)
                rendered[text] = fitted, len(fitted) < len(ids)
        return [list(rendered[text][0]) for text in texts], [rendered[text][1] for text in texts]

    def fit(self, ids: list[int]) -> list[int]:
        """At most max_prompt_tokens, the question's end kept (where it asks)."""
        if self.max_prompt_tokens is not None and len(ids) > self.max_prompt_tokens:
            return ids[-self.max_prompt_tokens:]
        return ids

    def render(self, text: str) -> list[int]:
        return self.fit(self.render_whole(text))

    def render_whole(self, text: str) -> list[int]:
        if self.use_chat:
            ids = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
            if isinstance(ids, dict) or hasattr(ids, "keys"):
                ids = ids["input_ids"]
        else:
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            bos = self.tokenizer.bos_token_id
            if bos is not None and getattr(self.tokenizer, "add_bos_token", False):
                ids = [bos] + ids
        return list(ids)


def decode_responses(tokenizer, rows: list[list[int]]) -> list[str]:
    """`batch_decode(rows, skip_special_tokens=True)`, through the Rust tokenizer's own batch call
    when that is the same thing (a fast tokenizer whose class keeps the base decode methods and
    does no clean-up of spaces): it decodes the rows in parallel, where transformers' per-row loop
    costs ~25 ms for a 256 × 256-token batch."""
    from transformers import PreTrainedTokenizerFast

    plain = isinstance(tokenizer, PreTrainedTokenizerFast) and all(
        getattr(type(tokenizer), name) is getattr(PreTrainedTokenizerFast, name)
        for name in ("decode", "_decode", "batch_decode"))
    if plain and not getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return tokenizer.backend_tokenizer.decode_batch(rows, skip_special_tokens=True)
    return tokenizer.batch_decode(rows, skip_special_tokens=True)
