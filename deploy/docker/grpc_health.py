#!/usr/bin/env python3
"""Container health check: exit 0 iff a gRPC server reports SERVING (grpc.health.v1).

Usage: kvbridge-grpc-health <host:port> [service name]
"""

from __future__ import annotations

import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def main(argv: list[str]) -> int:
    if len(argv) not in (2, 3):
        print(__doc__, file=sys.stderr)
        return 2
    service = argv[2] if len(argv) == 3 else ""
    with grpc.insecure_channel(argv[1]) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2.0)
        except grpc.RpcError as exc:
            print(f"unhealthy: {exc.code().name}", file=sys.stderr)
            return 1
    serving = reply.status == health_pb2.HealthCheckResponse.SERVING
    print("SERVING" if serving else health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))
    return 0 if serving else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
