"""gRPC channels from one kvbridge service to another: plaintext, TLS or mutual TLS per PeerTlsSettings."""

from __future__ import annotations

from collections.abc import Sequence

import grpc
from kvbridge.sdk.channel import tls_channel

from .config import PeerTlsSettings


def peer_channel(target: str, tls: PeerTlsSettings | None = None, *,
                 interceptors: Sequence[grpc.aio.ClientInterceptor] | None = None) -> grpc.aio.Channel:
    """A channel to another service; secure when ``tls`` names a CA (with a client certificate: mTLS)."""
    if tls is None or tls.ca_file is None:
        return tls_channel(target, root_certificates=None, interceptors=interceptors)
    return tls_channel(
        target, root_certificates=tls.ca_file.read_bytes(),
        private_key=tls.key_file.read_bytes() if tls.key_file is not None else None,
        certificate_chain=tls.cert_file.read_bytes() if tls.cert_file is not None else None,
        server_name=tls.server_name, interceptors=interceptors,
    )
