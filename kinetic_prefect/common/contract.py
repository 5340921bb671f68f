"""The records of the jobs store: one typed, versioned format for all of them.

Everything the runner, a pod, the builder or the local backend leaves for another
process to read is a `Record`: a pydantic model whose JSON names its `kind` (which
record it is) and its `version` (the format of that kind), next to its fields.
There is one codec for all of them::

    lease = LeaseRecord(flow_run_id="f", renewed_at=1.0, sequence=1, writer="w")
    assert LeaseRecord.decode(lease.encode(), "leases/f.json") == lease

Decoding is strict. A record of another kind, of a version this kinetic-prefect does
not know, with a field the model lacks or without one it requires raises
`kinetic_prefect.errors.RecordError`, which names the kind, the version, the field and
where the bytes came from. Nothing is dropped or filled in silently: a reader of a newer
format fails loudly instead of acting on half a record.

A `SignedRecord` carries an HMAC-SHA256 (`common.signing`) under the flow run's key over
every field but `signature`, `kind` and `version` included, so a record signed as one
kind does not verify as another.

`kinetic_prefect/pod/bootstrap.py` runs before kinetic-prefect is importable and so
writes the records it leaves (a phase failure's final state, an environment's manifest
and marker) as plain dicts; a unit test keeps their kinds, versions and field names
equal to the models'.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from kinetic_prefect.common import signing
from kinetic_prefect.errors import RecordError

R = TypeVar("R", bound="Record")


class Record(BaseModel):
    """A record of the jobs store. Subclasses fix `kind` and `version` with their defaults::

    class LeaseRecord(SignedRecord):
        kind: Literal["lease"] = "lease"
        version: int = 1
        flow_run_id: str
    """

    # Validators are built as each model is defined (no `defer_build`): a deferred build
    # is not thread-safe, and the runner decodes records from many threads.
    model_config = ConfigDict(extra="forbid")

    kind: str
    version: int

    # Every concrete record kind, so a reader can say which kind some bytes are.
    KINDS: ClassVar[dict[str, type[Record]]] = {}

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        kind = cls.model_fields["kind"].default
        if isinstance(kind, str):
            Record.KINDS[kind] = cls

    @classmethod
    def record_kind(cls) -> str:
        """The kind this model reads and writes."""
        return str(cls.model_fields["kind"].default)

    @classmethod
    def record_version(cls) -> int:
        """The version of its kind this model reads and writes."""
        return int(cls.model_fields["version"].default)

    @classmethod
    def field_names(cls) -> frozenset[str]:
        """The names of the record's fields as they appear in its JSON."""
        return frozenset(cls.model_fields)

    def fields(self) -> dict[str, Any]:
        """The record's fields as JSON values (what `encode` writes)."""
        return self.model_dump(mode="json")

    def encode(self) -> bytes:
        """The record as JSON bytes (sorted keys): what goes into the store."""
        return json.dumps(self.fields(), sort_keys=True).encode()

    @classmethod
    def decode(cls: type[R], data: bytes | str, source: str) -> R:
        """The record in `data`, read from `source` (a path or URI, for the error).

        Raises `RecordError` naming the kind, version or field when `data` is not
        exactly a record of this model's kind and version.
        """
        return cls.from_fields(parse_json(data, source, f"a {cls.record_kind()!r} record"), source)

    @classmethod
    def from_fields(cls: type[R], raw: Any, source: str) -> R:
        """The record in the decoded JSON value `raw` (see `decode`)."""
        expected = cls.record_kind()
        if not isinstance(raw, dict):
            raise RecordError(
                f"{source} is not a {expected!r} record: a JSON {type(raw).__name__}, "
                "not an object",
                source=source,
            )
        kind = raw.get("kind")
        if kind != expected:
            known = f"a {kind!r} record" if kind in Record.KINDS else f"of unknown kind {kind!r}"
            raise RecordError(
                f"{source} is {known}, not a {expected!r} record",
                source=source,
                kind=kind if isinstance(kind, str) else None,
            )
        version = raw.get("version")
        if version != cls.record_version():
            raise RecordError(
                f"{source} is a {expected!r} record of unknown version {version!r}: this "
                f"kinetic-prefect reads version {cls.record_version()}. Was it written by "
                "another kinetic-prefect version? Run the same version on both sides.",
                source=source,
                kind=expected,
                version=version if isinstance(version, int) else None,
            )
        try:
            return cls.model_validate(raw)
        except ValidationError as exc:
            raise _field_error(exc, expected, cls.record_version(), source) from exc


def parse_json(data: bytes | str, source: str, what: str) -> Any:
    """The JSON value in `data` read from `source`; `RecordError` saying it is not `what`."""
    try:
        return json.loads(data)
    except ValueError as exc:
        raise RecordError(f"{source} is not {what}: not JSON ({exc})", source=source) from exc


def _field_error(exc: ValidationError, kind: str, version: int, source: str) -> RecordError:
    """The first problem of a failed validation, in words naming the field."""
    problem = exc.errors()[0]
    field = ".".join(str(part) for part in problem["loc"]) or None
    what = f"{source}: {kind!r} record version {version}"
    if problem["type"] == "extra_forbidden":
        message = f"{what} has unknown field {field!r}"
    elif problem["type"] == "missing":
        message = f"{what} lacks field {field!r}"
    else:
        message = f"{what} has an invalid field {field!r}: {problem['msg']}"
    return RecordError(message, source=source, kind=kind, version=version, field=field)


class SignedRecord(Record):
    """A record signed with the flow run's key, over every field but `signature`."""

    signature: str | None = None

    def signed_fields(self) -> dict[str, Any]:
        return self.model_dump(mode="json", exclude={"signature"})

    def sign(self, key: str) -> None:
        """Sign the record with `key` (the flow run's record key)."""
        self.signature = signing.signature(key, self.signed_fields())

    def signed_by(self, key: str) -> bool:
        """True if the record carries a valid signature made with `key`."""
        return signing.verifies(key, self.signed_fields(), self.signature)

    def verify(self, key: str, source: str) -> None:
        """Raise `RecordError` (naming the `signature` field) unless `signed_by(key)`."""
        if not self.signed_by(key):
            what = "is not signed" if not self.signature else "has a signature that does not verify"
            raise RecordError(
                f"{source}: {self.kind!r} record version {self.version} {what} with the "
                "flow run's key",
                source=source,
                kind=self.kind,
                version=self.version,
                field="signature",
            )
