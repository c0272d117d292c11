"""Response shapes: how the chat API and the completions API each write a
choice, its streamed chunks and its logprobs. Everything the two endpoints
share (ids, usage, token ids, the SSE framing) is written once, elsewhere, over
this interface."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

from gateway.openai.choices import TopLogprobs
from gateway.openai.errors import APIError
from gateway.openai.requests import ChatCompletionRequest, CompletionRequest
from gateway.text import Tokenizer
from protocol.sampling import MAX_TOP_LOGPROBS


class ResponseShape(ABC):
    """The shape of one endpoint's responses, for one request.

    ``top_k``: how many alternatives each token's logprobs list (None: the
    request asked for no logprobs)."""

    endpoint: ClassVar[str]
    """The endpoint's label in the request metrics."""
    id_prefix: ClassVar[str]
    """Prefix of response ids."""
    prompt_param: ClassVar[str]
    """The request field that errors about the prompt point at."""
    default_max_tokens: ClassVar[int | None]
    """max_tokens when the request sets none (None: the rest of the context)."""
    object: ClassVar[str]
    """``object`` of a whole response."""
    chunk_object: ClassVar[str]
    """``object`` of a streamed chunk."""

    def __init__(self, tokenizer: Tokenizer, top_k: int | None) -> None:
        self.tokenizer = tokenizer
        self.top_k = top_k

    @classmethod
    @abstractmethod
    def for_request(cls, req: Any, tokenizer: Tokenizer) -> ResponseShape:
        """The shape for ``req``, whose logprobs fields it checks (``APIError``)."""

    def prompt_text(self, prompt_ids: list[int]) -> str:
        """Text that a choice's text starts with (the echoed prompt)."""
        return ""

    @abstractmethod
    def logprobs(
        self, ids: list[int], lps: list[float], tops: TopLogprobs, offset: int = 0
    ) -> dict[str, Any] | None:
        """The logprobs object of tokens ``ids`` (None when not asked for);
        ``offset``: where the first token starts in the choice's text."""

    def offset_after(self, offset: int, logprobs: dict[str, Any] | None) -> int:
        """Where the token after those of ``logprobs`` starts in the choice's
        text, the first of them starting at ``offset``."""
        return offset

    @abstractmethod
    def choice(
        self,
        index: int,
        text: str,
        logprobs: dict[str, Any] | None,
        finish: str | None,
        tool_calls: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        """One choice of a whole response (``tool_calls``: chat only)."""

    @abstractmethod
    def opening_choice(self, index: int, prompt_text: str) -> dict[str, Any] | None:
        """The choice of the chunk that opens a stream (None: no such chunk)."""

    @abstractmethod
    def chunk_choice(
        self,
        index: int,
        text: str,
        logprobs: dict[str, Any] | None,
        finish: str | None,
        tool_calls: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        """One choice of a streamed chunk: the text and tool calls (chat
        only) since the last chunk."""


class ChatShape(ResponseShape):
    endpoint = "chat"
    id_prefix = "chatcmpl-"
    prompt_param = "messages"
    default_max_tokens = None
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    @classmethod
    def for_request(cls, req: ChatCompletionRequest, tokenizer: Tokenizer) -> ChatShape:
        k = req.top_logprobs
        if k is not None and not 0 <= k <= MAX_TOP_LOGPROBS:
            raise APIError(
                400, f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}]", param="top_logprobs"
            )
        if k and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs set to true", param="top_logprobs")
        return cls(tokenizer, (k or 0) if req.logprobs else None)

    def logprobs(
        self, ids: list[int], lps: list[float], tops: TopLogprobs, offset: int = 0
    ) -> dict[str, Any] | None:
        if self.top_k is None:
            return None
        alts = tops if tops is not None and self.top_k else [[] for _ in ids]
        return {
            "content": [
                {**self._entry(t, lp), "top_logprobs": [self._entry(a, b) for a, b in top]}
                for t, lp, top in zip(ids, lps, alts)
            ]
        }

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        return {
            "token": self.tokenizer.decode([token_id]),
            "logprob": logprob,
            "bytes": list(self.tokenizer.token_bytes(token_id)),
        }

    def choice(
        self,
        index: int,
        text: str,
        logprobs: dict[str, Any] | None,
        finish: str | None,
        tool_calls: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if tool_calls:
            message["content"] = text or None
            message["tool_calls"] = [
                {k: v for k, v in call.items() if k != "index"} for call in tool_calls
            ]
        return {
            "index": index,
            "message": message,
            "logprobs": logprobs,
            "finish_reason": finish,
        }

    def opening_choice(self, index: int, prompt_text: str) -> dict[str, Any] | None:
        return {
            "index": index,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }

    def chunk_choice(
        self,
        index: int,
        text: str,
        logprobs: dict[str, Any] | None,
        finish: str | None,
        tool_calls: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        delta: dict[str, Any] = {"content": text} if text else {}
        if tool_calls:
            delta["tool_calls"] = tool_calls
        return {
            "index": index,
            "delta": delta,
            "logprobs": logprobs,
            "finish_reason": finish,
        }


class CompletionShape(ResponseShape):
    endpoint = "completions"
    id_prefix = "cmpl-"
    prompt_param = "prompt"
    default_max_tokens = 16
    object = "text_completion"
    chunk_object = "text_completion"

    def __init__(self, tokenizer: Tokenizer, top_k: int | None, echo: bool = False) -> None:
        super().__init__(tokenizer, top_k)
        self.echo = echo

    @classmethod
    def for_request(cls, req: CompletionRequest, tokenizer: Tokenizer) -> CompletionShape:
        k = req.logprobs
        if k is not None and not 0 <= k <= MAX_TOP_LOGPROBS:
            raise APIError(400, f"logprobs must be in [0, {MAX_TOP_LOGPROBS}]", param="logprobs")
        return cls(tokenizer, k, echo=req.echo)

    def prompt_text(self, prompt_ids: list[int]) -> str:
        return self.tokenizer.decode(prompt_ids) if self.echo else ""

    def logprobs(
        self, ids: list[int], lps: list[float], tops: TopLogprobs, offset: int = 0
    ) -> dict[str, Any] | None:
        if self.top_k is None:
            return None
        alts = tops if tops is not None and self.top_k else [[] for _ in ids]
        tokens = [self.tokenizer.decode([t]) for t in ids]
        offsets = []
        for tok in tokens:
            offsets.append(offset)
            offset += len(tok)
        top_dicts = []
        for tok, lp, top in zip(tokens, lps, alts):
            d = {self.tokenizer.decode([a]): b for a, b in top}
            d.setdefault(tok, lp)  # the chosen token is always listed
            top_dicts.append(d)
        return {
            "tokens": tokens,
            "token_logprobs": lps,
            "top_logprobs": top_dicts,
            "text_offset": offsets,
        }

    def offset_after(self, offset: int, logprobs: dict[str, Any] | None) -> int:
        if logprobs is None:
            return offset
        return offset + sum(len(t) for t in logprobs["tokens"])

    def choice(
        self,
        index: int,
        text: str,
        logprobs: dict[str, Any] | None,
        finish: str | None,
        tool_calls: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}

    def opening_choice(self, index: int, prompt_text: str) -> dict[str, Any] | None:
        if not self.echo:
            return None
        return {"index": index, "text": prompt_text, "logprobs": None, "finish_reason": None}

    def chunk_choice(
        self,
        index: int,
        text: str,
        logprobs: dict[str, Any] | None,
        finish: str | None,
        tool_calls: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
