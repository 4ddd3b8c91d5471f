"""gRPC channels from one kvbridge service to another: plaintext, TLS or mutual TLS per PeerTlsSettings."""

from __future__ import annotations

from collections.abc import Sequence

import grpc

from kvbridge.sdk.channel import tls_channel

from .config import PeerTlsSettings


def peer_channel(
    target: str,
    tls: PeerTlsSettings | None = None,
    *,
    interceptors: Sequence[grpc.aio.ClientInterceptor] | None = None,
    own_connection: bool = False,
) -> grpc.aio.Channel:
    """A channel to another service; secure when ``tls`` names a CA (with a client certificate: mTLS).

    ``own_connection``: a connection of its own instead of the process-wide shared one, so several channels to
    one target reach several of its server processes (SO_REUSEPORT spreads connections, not calls).
    """
    options = [("grpc.use_local_subchannel_pool", 1)] if own_connection else []
    if tls is None or tls.ca_file is None:
        return tls_channel(target, root_certificates=None, options=options, interceptors=interceptors)
    return tls_channel(
        target,
        root_certificates=tls.ca_file.read_bytes(),
        private_key=tls.key_file.read_bytes() if tls.key_file is not None else None,
        certificate_chain=tls.cert_file.read_bytes() if tls.cert_file is not None else None,
        server_name=tls.server_name,
        options=options,
        interceptors=interceptors,
    )
