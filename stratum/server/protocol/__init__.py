"""Request bodies, as pydantic models that mirror the Anthropic and OpenAI API references, one module
per API (`messages`, `chat_completions`, `responses` with its `response_items` and `response_tools`);
the bodies the routes read are named here."""

from stratum.server.protocol.chat_completions import ChatCompletionRequest, CompletionRequest
from stratum.server.protocol.messages import BatchCreateRequest, CountTokensRequest, MessagesRequest
from stratum.server.protocol.response_items import RespMessage
from stratum.server.protocol.responses import InputTokensRequest, ResponsesRequest

__all__ = ["BatchCreateRequest", "ChatCompletionRequest", "CompletionRequest", "CountTokensRequest",
           "InputTokensRequest", "MessagesRequest", "RespMessage", "ResponsesRequest"]
