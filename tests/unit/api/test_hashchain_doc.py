"""The test vectors in docs/hash-chain.md are what the code computes."""

from __future__ import annotations

import json
import re
from pathlib import Path

from kvbridge import hashchain

DOC = Path(__file__).resolve().parents[3] / "docs" / "hash-chain.md"
SECRET = b"kvbridge-test-secret-0123456789"


def _vectors() -> list[dict[str, object]]:
    match = re.search(r"```vectors\n(.*?)```", DOC.read_text(), re.S)
    assert match, "docs/hash-chain.md lost its ```vectors block"
    return [json.loads(line) for line in match.group(1).splitlines() if line.strip()]


def test_doc_has_vectors() -> None:
    assert len(_vectors()) >= 4


def test_doc_vectors_match_code() -> None:
    for v in _vectors():
        args = (SECRET, v["tenant"], v["model"], v["cache_salt"], v["block_size"])
        got = hashchain.chain(*args, v["tokens"])  # type: ignore[arg-type]
        assert [h.hex() for h in got] == v["hashes"], v
        if "seed" in v:
            assert hashchain.seed(*args).hex() == v["seed"]  # type: ignore[arg-type]
