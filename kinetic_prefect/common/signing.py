"""HMAC signatures over JSON fields: how every record a pod or runner leaves is authenticated.

A record's signature is an HMAC-SHA256, keyed by its flow run's key
(`kinetic_prefect.runner.record_key`), over its fields as canonical JSON (sorted
keys, the signature itself left out). Whoever can write the jobs bucket but
does not hold the key cannot make a record that verifies. `common.contract.SignedRecord`
signs the jobs store's records with it.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Mapping
from typing import Any


def signature(key: str, fields: Mapping[str, Any]) -> str:
    """The HMAC-SHA256 of `fields` (canonical JSON) under `key`."""
    canonical = json.dumps(dict(fields), sort_keys=True).encode()
    return hmac.new(key.encode(), canonical, hashlib.sha256).hexdigest()


def verifies(key: str, fields: Mapping[str, Any], signed: str | None) -> bool:
    """True if `signed` is the signature of `fields` under `key` (compared in constant time)."""
    if not signed or not key:
        return False
    return hmac.compare_digest(signature(key, fields), signed)
