"""`kvbridge hash` (issue 31): a prompt's block-hash chain for clients in other languages.

The output is kvbridge.hashchain's (docs/hash-chain.md's test vectors come out of the command), the secret is
read from KVBRIDGE_HASH_SECRET only, and --derive-salt gives the chain the gateway computes for the same prompt
and tenant (the per-tenant engine salt of docs/security.md), so a foreign client's keyed lookup matches what
the gateway's engines registered.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from kvbridge import hashchain
from kvbridge_services.cli import main
from kvbridge_services.gateway.kvparams import cache_salt_key
from kvbridge_services.gateway.requests import Limits, parse_turn

ROOT = Path(__file__).resolve().parents[3]
SECRET = b"kvbridge-test-secret-0123456789"  # docs/hash-chain.md's


def _vectors() -> list[dict[str, Any]]:
    match = re.search(r"```vectors\n(.*?)```", (ROOT / "docs" / "hash-chain.md").read_text(), re.S)
    assert match
    return [json.loads(line) for line in match.group(1).splitlines() if line.strip()]


def _hash(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict[str, Any], str]:
    code = main(["hash", *args])
    out, err = capsys.readouterr()
    return code, (json.loads(out) if code == 0 else {}), err


def test_doc_vectors_come_out_of_kvbridge_hash(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.setenv("KVBRIDGE_HASH_SECRET", SECRET.hex())
    vectors = _vectors()
    assert len(vectors) >= 4
    for i, v in enumerate(vectors):
        scope = ["--tenant", v["tenant"], "--model", v["model"], "--block-size", str(v["block_size"])]
        scope += ["--cache-salt", v["cache_salt"]]
        if i % 2:  # both inputs: an inline JSON array and a file
            ids = tmp_path / f"ids{i}.json"
            ids.write_text(json.dumps(v["tokens"]))
            code, out, err = _hash(capsys, *scope, "--tokens-file", str(ids))
        else:
            code, out, err = _hash(capsys, *scope, "--tokens", json.dumps(v["tokens"]))
        assert code == 0, err
        assert out["hashes"] == v["hashes"], v
        assert out["cache_salt"] == v["cache_salt"] and out["tokens"] == len(v["tokens"])


def test_derive_salt_is_the_gateways_chain(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """--derive-salt: the chain the gateway scopes the same completion by (parse_turn's engine salt)."""
    monkeypatch.setenv("KVBRIDGE_HASH_SECRET", SECRET.hex())
    tokens = list(range(100, 140))
    limits = Limits(max_messages=3, max_prompt_tokens=1000, cache_salt_key=cache_salt_key(SECRET))
    for client_salt in ("", "team-x"):
        body: dict[str, Any] = {"model": "m", "prompt": tokens, "cache_salt": client_salt}
        turn = parse_turn("completion", body, tenant="acme", session_header=None, limits=limits)
        gateway_chain = hashchain.chain(SECRET, "acme", "m", turn.cache_salt, 16, tokens)
        args = ["--tenant", "acme", "--model", "m", "--block-size", "16", "--tokens", json.dumps(tokens)]
        code, out, err = _hash(capsys, *args, "--cache-salt", client_salt, "--derive-salt")
        assert code == 0, err
        assert out["cache_salt"] == turn.cache_salt and out["cache_salt"].startswith("kvb1-")
        assert out["hashes"] == [h.hex() for h in gateway_chain] and len(out["hashes"]) == 2
        code, plain, _ = _hash(capsys, *args, "--cache-salt", client_salt)  # the client's salt as is: another chain
        assert code == 0 and plain["hashes"] != out["hashes"]


def test_secret_only_from_the_environment_and_bad_input_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as done:
        main(["hash", "--help"])
    help_text = capsys.readouterr().out
    assert done.value.code == 0
    assert (
        "KVBRIDGE_HASH_SECRET" in help_text and "--derive-salt" in help_text and "Engines' prefix caches" in help_text
    )
    assert not re.search(r"--\S*secret", help_text)  # the secret is never a flag
    args = ["--tenant", "acme", "--model", "m", "--block-size", "4"]
    monkeypatch.delenv("KVBRIDGE_HASH_SECRET", raising=False)
    code, _, err = _hash(capsys, *args, "--tokens", "[1, 2, 3, 4]")
    assert code == 2 and "KVBRIDGE_HASH_SECRET" in err and err.count("\n") == 1
    monkeypatch.setenv("KVBRIDGE_HASH_SECRET", "not-hex")
    code, _, err = _hash(capsys, *args, "--tokens", "[1, 2, 3, 4]")
    assert code == 2 and "must be hex" in err and err.count("\n") == 1
    monkeypatch.setenv("KVBRIDGE_HASH_SECRET", SECRET.hex())
    for bad in ("[1, -1]", "[1.5]", '{"a": 1}', "[1,", "[true]"):
        code, _, err = _hash(capsys, *args, "--tokens", bad)
        assert code == 2 and err.startswith("kvbridge: hash: ") and err.count("\n") == 1, (bad, err)
    code, _, err = _hash(capsys, "--tenant", "acme", "--model", "m", "--block-size", "0", "--tokens", "[1]")
    assert code == 2 and "block_size" in err
