"""Prompt inputs (text, chat messages, token ids) to token ids, with the model's tokenizer and chat template."""

from __future__ import annotations

from typing import Any

from cbd.errors import InvalidRequest
from cbd.server.special_tokens import SpecialTokens
from cbd.server.tool_calls import Tool, detect_format, render_messages
from cbd_client.v1 import cbd_pb2 as pb


class PromptEncoder:
    def __init__(self, tokenizer: Any | None) -> None:
        self.tokenizer = tokenizer
        self.special = SpecialTokens(tokenizer) if tokenizer is not None else None
        self.call_format = detect_format(getattr(tokenizer, "chat_template", None) if tokenizer is not None else None)
        self._token_texts: dict[int, str] = {}  # at most the vocabulary

    def token_text(self, token_id: int) -> str:
        """One token's text as the tokenizer decodes it alone ("" without a tokenizer); for logprobs."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = "" if self.tokenizer is None else self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._token_texts[token_id] = text
        return text

    @property
    def has_chat_template(self) -> bool:
        return self.tokenizer is not None and bool(getattr(self.tokenizer, "chat_template", None))

    def encode(self, message: pb.GenerateRequest | pb.TokenizeRequest, tools: list[Tool] | None = None) -> list[int]:
        kind = message.WhichOneof("input")
        if kind is None:
            inputs = "text, chat or tokens" if isinstance(message, pb.GenerateRequest) else "text or chat"
            raise InvalidRequest(f"a prompt is required: set one of {inputs}")
        if kind == "tokens":
            return list(message.tokens.ids)
        if kind == "text":
            return self._special().encode_text(message.text, True, message.allow_special_tokens)
        return self._chat(message.chat, tools)

    def _special(self) -> SpecialTokens:
        if self.special is None:
            raise InvalidRequest("this model has no tokenizer; send token ids")
        return self.special

    def _chat(self, chat: pb.Chat, tools: list[Tool] | None) -> list[int]:
        messages = self.messages(chat)
        if chat.continue_final_message:
            last = messages[-1]
            if last["role"] != "assistant" or last.get("tool_calls"):
                raise InvalidRequest("continue_final_message needs the last message to be an assistant's text")
            if not last["content"] or last["content"] != last["content"].rstrip():
                raise InvalidRequest("continue_final_message: the last message's content must be text that does "
                                     "not end in whitespace")  # fmt: skip
            return self.render(messages, False, tools, continue_final=True)
        add_prompt = chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True
        return self.render(messages, add_prompt, tools)

    def messages(self, chat: pb.Chat) -> list[dict]:
        if not self.has_chat_template:
            raise InvalidRequest("this model has no chat template; send text or token ids")
        if not chat.messages:
            raise InvalidRequest("chat needs at least one message")
        messages = []
        for i, m in enumerate(chat.messages):
            if not m.role:
                raise InvalidRequest(f"chat message {i} has no role")
            message: dict = {"role": m.role, "content": m.content}
            if m.tool_calls:
                message["tool_calls"] = [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in m.tool_calls]
            if m.tool_call_id:
                message["tool_call_id"] = m.tool_call_id
            messages.append(message)
        return messages

    def render(
        self, messages: list[dict], add_generation_prompt: bool, tools: list[Tool] | None = None,
        continue_final: bool = False,
    ) -> list[int]:  # fmt: skip
        """Token ids of a conversation; tool calls, tool results and tools in the model family's way.
        continue_final: the rendering ends inside the last message (a reply to continue)."""
        fmt, special = self.call_format, self._special()
        kwargs: dict = {"tools": [t.openai() for t in tools]} if tools and fmt.template_renders_tools else {}
        if continue_final:
            kwargs["continue_final_message"] = True
        try:
            return special.render(render_messages(fmt, messages, tools or []), add_generation_prompt, **kwargs)
        except Exception as exc:  # jinja errors raised by the template itself (e.g. role order)
            raise InvalidRequest(f"the chat template rejected the messages: {exc}") from exc

    def continuation(self, message: pb.GenerateRequest | pb.OpenSessionRequest, field: str) -> list[int]:
        """Token ids of text or token input that extends a session (no special tokens added)."""
        if field == "tokens":
            return list(message.tokens.ids)
        return self._special().encode_text(message.text, False, message.allow_special_tokens)
