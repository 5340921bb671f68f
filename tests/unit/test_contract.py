"""The jobs store's records: one codec, strict decoding, signing, and the bootstrap's copies."""

from __future__ import annotations

import json
import pickle
from typing import Any

import pytest

from kinetic_prefect.backends.local.pods import LocalPodRecord
from kinetic_prefect.common.contract import Record, SignedRecord
from kinetic_prefect.common.environment_records import (
    EnvironmentManifest,
    EnvironmentMarker,
    EnvironmentSpec,
    WheelEntry,
)
from kinetic_prefect.common.handover import Assignment, Claim, batch_from_json, batch_to_json
from kinetic_prefect.common.lease import LeaseRecord
from kinetic_prefect.common.records import FinalRecord, ResultSeal
from kinetic_prefect.data.marker import DataMarker
from kinetic_prefect.errors import RecordError
from kinetic_prefect.pod import bootstrap

KEY = "k" * 32
SOURCE = "gs://jobs/kinetic/kp-1/record.json"

RECORDS: list[Record] = [
    FinalRecord(
        status="finished",
        state_type="COMPLETED",
        versions={"prefect": "3.9.1"},
        timings={"run": 0.25},
        next_job="kp-2",
    ),
    ResultSeal(
        flow_run_id="f", task_run_id="t", storage_block_id="b", storage_key="k", sha256="0" * 64
    ),
    LeaseRecord(flow_run_id="f", renewed_at=1.5, sequence=3, writer="w", ending="ended"),
    Assignment(
        job_id="kp-1",
        task_run_id="t",
        job_dir="gs://jobs/kinetic/kp-1",
        payload="gs://jobs/kinetic/kp-1/payload.pkl",
        payload_sha256="1" * 64,
        context="gs://jobs/code-cache/2.zip",
        context_sha256="2" * 64,
        env={"A": "1"},
        payload_inline="cGF5bG9hZA==",
    ),
    Claim(pod="kp-pod", sequence=2, by_runner=True),
    DataMarker(sha256="3" * 64, content="dir", files=[("a/b.txt", 4, "4" * 64)]),
    LocalPodRecord(job_id="kp-1", labels={"l": "v"}, launched_at=2.0, pid=7, exit_code=0),
    EnvironmentSpec(
        key="e",
        python="3.11",
        platform="x86_64-manylinux_2_36",
        pins=["prefect==3.9.1"],
        wheels=[WheelEntry(name="w.whl", sha256="5" * 64)],
    ),
    EnvironmentManifest(
        key="e",
        sha256="6" * 64,
        size=10,
        files=2,
        python="3.11",
        platform="x86_64-manylinux_2_36",
        pins=[],
        wheels=[],
        install_seconds=1.0,
        pack_seconds=0.5,
        built_by="builder Job",
    ),
    EnvironmentMarker(sha256="6" * 64, size=10, files=2),
]
SIGNED = [r for r in RECORDS if isinstance(r, SignedRecord)]


def _ids(records: list[Record]) -> list[str]:
    return [r.kind for r in records]


def _fields(record: Record) -> dict[str, Any]:
    return json.loads(record.encode())


def _required(record: Record) -> str:
    return next(
        name
        for name, info in type(record).model_fields.items()
        if info.is_required() and name not in ("kind", "version")
    )


def test_every_record_kind_has_a_case_here() -> None:
    assert set(Record.KINDS) == {r.kind for r in RECORDS}


@pytest.mark.parametrize("record", RECORDS, ids=_ids(RECORDS))
def test_a_record_decodes_to_what_was_encoded(record: Record) -> None:
    assert type(record).decode(record.encode(), SOURCE) == record


@pytest.mark.parametrize("record", RECORDS, ids=_ids(RECORDS))
def test_a_record_names_its_kind_and_version_in_its_json(record: Record) -> None:
    fields = _fields(record)
    assert (fields["kind"], fields["version"]) == (type(record).record_kind(), record.version)


@pytest.mark.parametrize("record", SIGNED, ids=_ids(SIGNED))
def test_a_signed_record_still_verifies_after_a_round_trip(record: SignedRecord) -> None:
    record = record.model_copy()
    record.sign(KEY)
    decoded = type(record).decode(record.encode(), SOURCE)
    decoded.verify(KEY, SOURCE)
    assert decoded.signed_by(KEY)


@pytest.mark.parametrize("record", RECORDS, ids=_ids(RECORDS))
def test_a_record_of_an_unknown_kind_is_an_error_naming_the_kind(record: Record) -> None:
    with pytest.raises(RecordError, match="unknown kind 'no-such-kind'") as raised:
        type(record).decode(json.dumps({**_fields(record), "kind": "no-such-kind"}), SOURCE)
    assert (raised.value.kind, raised.value.source) == ("no-such-kind", SOURCE)
    assert SOURCE in str(raised.value)


def test_a_record_of_another_known_kind_is_an_error_naming_both_kinds() -> None:
    lease = LeaseRecord(flow_run_id="f", renewed_at=1.0, sequence=1, writer="w")
    with pytest.raises(RecordError, match="is a 'lease' record, not a 'final-state' record"):
        FinalRecord.decode(lease.encode(), SOURCE)


@pytest.mark.parametrize("record", RECORDS, ids=_ids(RECORDS))
def test_a_record_of_an_unknown_version_is_an_error_naming_the_version(record: Record) -> None:
    newer = record.version + 1
    with pytest.raises(RecordError, match=f"unknown version {newer}") as raised:
        type(record).decode(json.dumps({**_fields(record), "version": newer}), SOURCE)
    assert (raised.value.kind, raised.value.version) == (record.kind, newer)
    assert SOURCE in str(raised.value)


@pytest.mark.parametrize("record", RECORDS, ids=_ids(RECORDS))
def test_a_record_with_an_unknown_field_is_an_error_naming_the_field(record: Record) -> None:
    with pytest.raises(RecordError, match="unknown field 'surprise'") as raised:
        type(record).decode(json.dumps({**_fields(record), "surprise": 1}), SOURCE)
    assert (raised.value.kind, raised.value.field) == (record.kind, "surprise")
    assert SOURCE in str(raised.value)


@pytest.mark.parametrize("record", RECORDS, ids=_ids(RECORDS))
def test_a_record_missing_a_field_is_an_error_naming_the_field(record: Record) -> None:
    missing = _required(record)
    fields = {k: v for k, v in _fields(record).items() if k != missing}
    with pytest.raises(RecordError, match=f"lacks field '{missing}'") as raised:
        type(record).decode(json.dumps(fields), SOURCE)
    assert (raised.value.kind, raised.value.field) == (record.kind, missing)
    assert SOURCE in str(raised.value)


@pytest.mark.parametrize("record", SIGNED, ids=_ids(SIGNED))
def test_a_record_signed_with_another_key_is_an_error_naming_the_signature(
    record: SignedRecord,
) -> None:
    record = record.model_copy()
    record.sign("another key")
    decoded = type(record).decode(record.encode(), SOURCE)
    with pytest.raises(RecordError, match="signature that does not verify") as raised:
        decoded.verify(KEY, SOURCE)
    assert (raised.value.kind, raised.value.field, raised.value.source) == (
        record.kind,
        "signature",
        SOURCE,
    )


def test_a_record_changed_after_signing_no_longer_verifies() -> None:
    lease = LeaseRecord(flow_run_id="f", renewed_at=1.0, sequence=1, writer="w")
    lease.sign(KEY)
    changed = LeaseRecord.decode(json.dumps({**_fields(lease), "sequence": 2}), SOURCE)
    with pytest.raises(RecordError, match="'lease' record version 1 has a signature"):
        changed.verify(KEY, SOURCE)


@pytest.mark.parametrize("record", SIGNED, ids=_ids(SIGNED))
def test_an_unsigned_record_is_an_error_naming_the_signature(record: SignedRecord) -> None:
    with pytest.raises(RecordError, match="is not signed") as raised:
        type(record).decode(record.encode(), SOURCE).verify(KEY, SOURCE)
    assert raised.value.field == "signature"


def test_the_signature_covers_the_kind_and_version() -> None:
    lease = LeaseRecord(flow_run_id="f", renewed_at=1.0, sequence=1, writer="w")
    lease.sign(KEY)
    assert not lease.model_copy(update={"version": 2}).signed_by(KEY)


@pytest.mark.parametrize("data", [b"not json", b"[1, 2]", b'"text"'])
def test_bytes_that_are_no_record_are_an_error_naming_their_source(data: bytes) -> None:
    with pytest.raises(RecordError, match="is not a 'lease' record") as raised:
        LeaseRecord.decode(data, SOURCE)
    assert raised.value.source == SOURCE


def test_a_record_error_survives_pickling_with_its_attributes() -> None:
    error = RecordError("m", source=SOURCE, kind="lease", version=9, field="f")
    copy = pickle.loads(pickle.dumps(error))
    assert (str(copy), copy.source, copy.kind, copy.version, copy.field) == (
        "m",
        SOURCE,
        "lease",
        9,
        "f",
    )


def test_an_assignment_batch_is_a_list_of_assignment_records() -> None:
    (task,) = [r for r in RECORDS if isinstance(r, Assignment)]
    data = batch_to_json([task, task])
    assert [item["kind"] for item in json.loads(data)] == ["assignment", "assignment"]
    assert batch_from_json(data, SOURCE) == [task, task]


def test_an_assignment_batch_with_an_unknown_field_names_the_task_it_is_in() -> None:
    (task,) = [r for r in RECORDS if isinstance(r, Assignment)]
    items = [task.fields(), {**task.fields(), "surprise": 1}]
    with pytest.raises(RecordError, match=r"record\.json\[1\]: 'assignment' .* 'surprise'"):
        batch_from_json(json.dumps(items).encode(), SOURCE)


# -- the bootstrap's copies (it runs before kinetic-prefect is importable) ---------------------


@pytest.mark.parametrize(
    ("model", "kind", "version", "fields"),
    [
        (
            FinalRecord,
            bootstrap.FINAL_STATE_KIND,
            bootstrap.FINAL_STATE_VERSION,
            bootstrap.FINAL_STATE_FIELDS,
        ),
        (
            EnvironmentManifest,
            bootstrap.MANIFEST_KIND,
            bootstrap.MANIFEST_VERSION,
            bootstrap.MANIFEST_FIELDS,
        ),
        (
            EnvironmentMarker,
            bootstrap.MARKER_KIND,
            bootstrap.MARKER_VERSION,
            bootstrap.MARKER_FIELDS,
        ),
    ],
    ids=["final-state", "environment-manifest", "environment-marker"],
)
def test_the_bootstrap_writes_records_as_the_models_define_them(
    model: type[Record], kind: str, version: int, fields: tuple[str, ...]
) -> None:
    assert (kind, version) == (model.record_kind(), model.record_version())
    assert {"kind", "version", *fields} == model.field_names()


def test_the_bootstrap_reads_the_spec_as_the_model_defines_it() -> None:
    assert (
        EnvironmentSpec.record_kind(),
        EnvironmentSpec.record_version(),
    ) == (bootstrap.SPEC_KIND, bootstrap.SPEC_VERSION)
    assert set(bootstrap.SPEC_FIELDS_READ) <= EnvironmentSpec.field_names()
    assert set(bootstrap.WHEEL_FIELDS) == set(WheelEntry.model_fields)
