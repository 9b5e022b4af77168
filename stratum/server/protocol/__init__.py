"""Request bodies, as pydantic models that mirror the Anthropic and OpenAI API references, one module
per API (`messages`, `chat_completions`, `responses`); the bodies the routes read are named here."""

from stratum.server.protocol.chat_completions import ChatCompletionRequest, CompletionRequest
from stratum.server.protocol.messages import BatchCreateRequest, CountTokensRequest, MessagesRequest
from stratum.server.protocol.responses import RespMessage, ResponsesRequest

__all__ = ["BatchCreateRequest", "ChatCompletionRequest", "CompletionRequest", "CountTokensRequest", "MessagesRequest",
           "RespMessage", "ResponsesRequest"]
