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


def test_doc_prefix_digest_vectors_match_code_and_the_definition() -> None:
    import hashlib
    import struct

    match = re.search(r"```digest-vectors\n(.*?)```", DOC.read_text(), re.S)
    assert match, "docs/hash-chain.md lost its ```digest-vectors block"
    vectors = [json.loads(line) for line in match.group(1).splitlines() if line.strip()]
    assert len(vectors) >= 2
    for v in vectors:
        n, tokens = v["num_tokens"], v["tokens"]
        tag = hashchain.PREFIX_DIGEST_TAG.encode()
        # The definition, spelled out independently of the implementation.
        raw = struct.pack("<I", len(tag)) + tag + struct.pack("<I", n) + struct.pack(f"<{n}I", *tokens[:n])
        assert hashlib.sha256(raw).hexdigest() == v["digest"]
        assert hashchain.prefix_digest(tokens, n) == v["digest"]
