"""Exceptions raised by kinetic-prefect; each message says what to do next."""

from __future__ import annotations


class KineticError(Exception):
    """Base class for every error kinetic-prefect raises on its own account."""


class ConfigurationError(KineticError, ValueError):
    """A setting is missing or invalid; raised before any pod starts."""


class PayloadError(KineticError, TypeError):
    """A task or one of its arguments cannot be shipped to a pod."""


class PodPhaseError(KineticError):
    """The pod failed before or after running the task, in a named phase.

    Attributes:
        phase: the pod phase that failed (`download`, `verify`, `extract`, `unpickle`,
            `environment`, `run` or `report`).
        job_id: the Kinetic job whose pod failed.
    """

    def __init__(
        self, message: str, *, phase: str, job_id: str, remote_traceback: str = ""
    ) -> None:
        super().__init__(message)
        self.phase = phase
        self.job_id = job_id
        self.remote_traceback = remote_traceback

    def __reduce__(self):  # keep the keyword-only attributes across pickling
        return (_rebuild_phase_error, (str(self), self.phase, self.job_id, self.remote_traceback))


def _rebuild_phase_error(message: str, phase: str, job_id: str, tb: str) -> PodPhaseError:
    return PodPhaseError(message, phase=phase, job_id=job_id, remote_traceback=tb)


class ResultNotStoredError(KineticError, RuntimeError):
    """A task returned but its persisted result is not in result storage (the message says why)."""


class PodCrashedError(KineticError):
    """The pod ended without reporting a final state (killed, evicted, out of memory, deadline)."""


class PodStartError(KineticError):
    """The pod never started: image pull error, unschedulable, quota; the message says which."""


class RemoteTraceback(Exception):
    """Carries the traceback text of an exception raised inside a pod.

    Attached as ``__cause__`` of the re-raised exception so that the formatted
    exception shows the frames of the task function as they ran in the pod.
    """

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return f"\n\nTraceback from the pod:\n{self.text}"


class TamperedRecordError(KineticError):
    """A pod's final-state record failed its integrity check and was not unpickled."""


class TamperedResultError(TamperedRecordError):
    """A task's result record in result storage is not what its pod signed; not unpickled."""


class CheckpointError(KineticError, LookupError):
    """A `Checkpoint` has no step to give, or a template does not fit what it holds."""


class EnvironmentBuildError(KineticError):
    """The task's shipped environment could not be resolved, built or stored.

    The message names the requirement, or the builder's reason, and what to do.
    """


class RecordError(KineticError, ValueError):
    """A record read from the jobs store is not one this kinetic-prefect can read.

    Attributes:
        source: where the record was read from (a path or URI).
        kind: the record's kind, when it names one.
        version: the record's version, when it is the version that is unknown.
        field: the unknown, missing or invalid field, when one is at fault.
    """

    def __init__(
        self,
        message: str,
        *,
        source: str,
        kind: str | None = None,
        version: int | None = None,
        field: str | None = None,
    ) -> None:
        super().__init__(message)
        self.source = source
        self.kind = kind
        self.version = version
        self.field = field

    def __reduce__(self):  # keep the keyword-only attributes across pickling
        return (
            _rebuild_record_error,
            (str(self), self.source, self.kind, self.version, self.field),
        )


def _rebuild_record_error(
    message: str, source: str, kind: str | None, version: int | None, field: str | None
) -> RecordError:
    return RecordError(message, source=source, kind=kind, version=version, field=field)
