"""kvbridge Python client SDK (asyncio): registry, lease manager, gateway.

Every call has a deadline, retries UNAVAILABLE with exponential backoff
(following a NOT_LEADER redirect when the server names the leader), and raises
the typed exceptions of :mod:`kvbridge.errors`.
"""

from .channel import ClientOptions, open_channel
from .lease import Heartbeater, LeaseClient
from .registry import RegistryClient

__all__ = ["ClientOptions", "Heartbeater", "LeaseClient", "RegistryClient", "open_channel"]
