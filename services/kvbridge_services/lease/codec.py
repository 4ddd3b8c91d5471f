"""LeaseRecord <-> lease.v1.Lease, and the time conversions both directions need."""

from __future__ import annotations

from google.protobuf import duration_pb2, timestamp_pb2

from kvbridge.lease.v1 import lease_pb2

from .table import LeaseRecord


def set_timestamp(ts: timestamp_pb2.Timestamp, seconds: float) -> None:
    whole = int(seconds)
    ts.seconds = whole
    ts.nanos = int((seconds - whole) * 1e9)


def set_duration(d: duration_pb2.Duration, seconds: float) -> None:
    whole = int(seconds)
    d.seconds = whole
    d.nanos = round((seconds - whole) * 1e9)


def timestamp_s(ts: timestamp_pb2.Timestamp) -> float:
    return ts.seconds + ts.nanos / 1e9


def duration_s(d: duration_pb2.Duration) -> float:
    return d.seconds + d.nanos / 1e9


def to_proto(record: LeaseRecord, out: lease_pb2.Lease | None = None) -> lease_pb2.Lease:
    lease = lease_pb2.Lease() if out is None else out
    lease.lease_id = record.lease_id
    lease.kind = record.kind  # type: ignore[assignment]
    lease.tenant = record.tenant
    lease.engine_id = record.engine_id
    lease.model = record.model
    lease.conversation_key = record.conversation_key
    lease.retained_tokens = record.retained_tokens
    set_duration(lease.ttl, record.ttl_s)
    set_timestamp(lease.deadline, record.deadline)
    set_timestamp(lease.grant_time, record.grant_time)
    set_timestamp(lease.last_renew_time, record.last_renew_time)
    set_timestamp(lease.max_deadline, record.max_deadline)
    lease.request_id = record.request_id
    return lease


def from_proto(lease: lease_pb2.Lease) -> LeaseRecord:
    return LeaseRecord(
        lease_id=lease.lease_id,
        kind=lease.kind,
        tenant=lease.tenant,
        engine_id=lease.engine_id,
        model=lease.model,
        conversation_key=lease.conversation_key,
        retained_tokens=lease.retained_tokens,
        ttl_s=duration_s(lease.ttl),
        grant_time=timestamp_s(lease.grant_time),
        max_deadline=timestamp_s(lease.max_deadline),
        deadline=timestamp_s(lease.deadline),
        last_renew_time=timestamp_s(lease.last_renew_time),
        request_id=lease.request_id,
    )
