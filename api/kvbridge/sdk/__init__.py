"""kvbridge Python client SDK (asyncio): gateway, registry, lease manager; blocking twins in :mod:`.sync`.

Every call has a deadline, retries UNAVAILABLE with exponential backoff
(following a NOT_LEADER redirect when the server names the leader; a stream
only before its first message), and raises the typed exceptions of
:mod:`kvbridge.errors`. Guide: docs/sdk.md.
"""

from .channel import ClientOptions, open_channel
from .conversation import Conversation, ConversationLeases, new_conversation_key
from .gateway import Completion, GatewayClient, Sampling
from .lease import Heartbeater, LeaseClient
from .registry import RegistryClient

__all__ = [
    "ClientOptions",
    "Completion",
    "Conversation",
    "ConversationLeases",
    "GatewayClient",
    "Heartbeater",
    "LeaseClient",
    "RegistryClient",
    "Sampling",
    "new_conversation_key",
    "open_channel",
]
