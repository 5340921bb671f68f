"""The records of a shipped environment in the jobs store, `env-cache/{key}/`.

`spec.json` (`EnvironmentSpec`) is what the orchestrator asks the builder for; the
builder (`kinetic_prefect/pod/bootstrap.py build`, standard library only) copies it
into the environment as `kinetic-environment.json`, then writes `manifest.json`
(`EnvironmentManifest`) and, last, `ready.json` (`EnvironmentMarker`): an
environment whose marker is there is complete. The bootstrap writes and reads these
as plain dicts; a unit test keeps its kinds, versions and field names equal to these
models'.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from kinetic_prefect.common.contract import Record

# The version of the spec's format. It is part of every environment's key, so an
# environment stored in an older format is never read: it is built again.
SPEC_VERSION = 3


class WheelEntry(BaseModel):
    """A local wheel that goes into an environment: its file name and sha256."""

    model_config = ConfigDict(extra="forbid")

    name: str
    sha256: str


class _Pinned(Record):
    """What a spec asks for and its manifest repeats: the key, Python, platform, pins, wheels."""

    key: str
    python: str
    platform: str
    pins: list[str]
    wheels: list[WheelEntry] = Field(default_factory=list)


class EnvironmentSpec(_Pinned):
    """`spec.json`: the resolved pins, the platform and Python, the local wheels."""

    kind: Literal["environment-spec"] = "environment-spec"
    version: int = SPEC_VERSION
    index_url: str | None = None
    extras: list[str] = Field(default_factory=list)
    requirements: str = ""


class EnvironmentManifest(_Pinned):
    """`manifest.json`: what the builder built, from what, and how long it took."""

    kind: Literal["environment-manifest"] = "environment-manifest"
    version: int = 1
    sha256: str
    size: int
    files: int
    install_seconds: float
    pack_seconds: float
    built_by: str | None = None


class EnvironmentMarker(Record):
    """`ready.json`, written last: the archive's sha256, size and number of files."""

    kind: Literal["environment-marker"] = "environment-marker"
    version: int = 1
    sha256: str
    size: int
    files: int
