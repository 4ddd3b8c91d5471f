"""Stock vLLM NixlConnector, bidirectional: turn 2 pulls D's turn-1 KV back to P.

Also pins down vLLM's wire protocol (docs/vllm-pd-protocol.md): the fields P and D
return in ``kv_transfer_params`` and what P reports after a pull.
"""

from __future__ import annotations

import random

import pytest

from tests.e2e.pd_client import pd_turn, random_tokens
from tests.fixtures.vllm_engines import BLOCK_SIZE, PDEngines

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

P_FIELDS = {
    "do_remote_prefill",
    "do_remote_decode",
    "remote_block_ids",
    "remote_engine_id",
    "remote_request_id",
    "remote_host",
    "remote_port",
    "tp_size",
    "dcp_size",
    "pp_size",
    "remote_num_tokens",
    "remote_blocks_expiry_time",
    "transfer_mode",
    "remote_prefill_cached_tokens",
}


def test_two_turns_pull_decode_kv_and_match_no_reuse(pd_engines: PDEngines) -> None:
    prefill, decode = pd_engines.prefill, pd_engines.decode
    rng = random.Random(11)
    prompt1 = random_tokens(rng, 200)

    turn1 = pd_turn(prefill, decode, prompt1, 40)
    assert len(turn1.output_ids) == 40
    # P's answer: where D pulls the prompt's KV from.
    assert set(turn1.prefill_params) >= P_FIELDS
    assert turn1.prefill_params["do_remote_prefill"] is True
    assert turn1.prefill_params["remote_engine_id"] == prefill.engine_id
    assert turn1.prefill_params["remote_num_tokens"] == len(prompt1)
    assert turn1.pulled_tokens == 0
    # D's answer: where its retained KV (prompt + answer but the last token) lives.
    d_params = turn1.decode_params
    assert d_params["do_remote_decode"] is True and d_params["do_remote_prefill"] is False
    assert d_params["remote_engine_id"] == decode.engine_id
    assert d_params["remote_port"] == decode.side_channel_port
    assert d_params["remote_num_tokens"] == len(prompt1) + len(turn1.output_ids) - 1
    assert len(d_params["remote_block_ids"]) == 1  # one KV-cache group
    assert len(d_params["remote_block_ids"][0]) == -(-d_params["remote_num_tokens"] // BLOCK_SIZE)
    assert isinstance(d_params["remote_blocks_expiry_time"], float)

    prompt2 = prompt1 + turn1.output_ids + random_tokens(rng, 50)
    reused = pd_turn(prefill, decode, prompt2, 30, reuse=d_params)
    assert reused.pulled_tokens == d_params["remote_num_tokens"]

    fresh = pd_turn(prefill, decode, prompt2, 30)
    assert fresh.pulled_tokens == 0
    assert reused.output_ids == fresh.output_ids
