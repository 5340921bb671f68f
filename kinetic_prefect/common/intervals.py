"""Every interval kinetic-prefect waits on, in one settings object.

The runner, the backends, the CLI and the pods all read their intervals from an
`Intervals`, never from module constants, so a deployment (or a test suite) can
change any of them in one place. The defaults are the production values;
docs/intervals.md is the table of what each one does.

`Intervals` is resolved like every other setting (`KineticTaskRunner(intervals=...)`,
the `KineticCluster` block, then `KINETIC_INTERVALS`, a JSON object of the fields to
change), and a pod gets the values its runner resolved through its manifest's
`KINETIC_INTERVALS`, so both sides of a launch agree:

    KINETIC_INTERVALS='{"watchdog_look_seconds": 5, "settle_margin_seconds": 10}'

Nothing here imports beyond the standard library: the pod reads it first thing.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kinetic_prefect.common.env import INTERVALS_ENV
from kinetic_prefect.errors import ConfigurationError


@dataclass(frozen=True)
class Intervals:
    """The intervals, in seconds. See docs/intervals.md for each one's role.

    Example:
        ```python
        KineticTaskRunner(intervals={"settle_margin_seconds": 10})
        ```
    """

    # -- gke backend: deciding how a job ended, and its probes ------------------------
    # How long to wait for a pod's own final status after its Job ended or was deleted
    # (beyond the cancel grace).
    settle_margin_seconds: float = 30.0
    # How long to wait for the Job's reason after its pod vanished without a final status.
    pod_gone_settle_seconds: float = 5.0
    # A Job that has no pod after this long is checked for FailedCreate events (quota).
    events_probe_seconds: float = 10.0
    # Then again this often while it has no pod.
    events_probe_interval_seconds: float = 15.0
    # How often the Workloads of Jobs waiting in a Kueue LocalQueue are read.
    queue_poll_seconds: float = 10.0
    # A Job whose Kueue queue Kueue says does not exist fails once every read for this long
    # has said so (Kueue can say it for a moment after it restarts, or a queue is created).
    missing_queue_grace_seconds: float = 60.0
    # The API server ends a watch after at most this long; the watcher then resumes.
    watch_timeout_seconds: float = 300.0
    # exec / gcp-auth tokens (gke-gcloud-auth-plugin) last an hour; refreshed this often.
    token_refresh_seconds: float = 300.0
    # How long a created Job waits for others to share its Secret's owner patch.
    owner_batch_seconds: float = 1.0
    # `jobs cleanup` leaves an unowned Secret younger than this alone (its Job is coming).
    secret_orphan_grace_seconds: float = 600.0

    # -- runner -------------------------------------------------------------------------
    # The most time between a cancel in the UI and the runner marking its lease `ending`.
    flow_run_look_seconds: float = 15.0
    # A busy warm pod's final record is read regardless of the API this often at first ...
    warm_direct_look_seconds: float = 10.0
    # ... and at most this far apart as its task goes on.
    warm_max_direct_look_seconds: float = 60.0
    # How long the warm poller waits for the API's answer before it reads records itself.
    warm_api_wait_seconds: float = 2.0
    # The most a write taking a queued task back for an idle pod may take, retries
    # included: the warm pool waits for it before anything else of its changes.
    warm_take_back_seconds: float = 10.0
    # Beyond the pods' grace: how long deleting a reattached Job and seeing its pod end may take.
    reattach_stop_slack_seconds: float = 60.0

    # -- worker -------------------------------------------------------------------------
    # Time for a backend to report a cancelled flow pod's exit beyond Prefect's grace.
    exit_report_margin_seconds: float = 15.0

    # -- pods ---------------------------------------------------------------------------
    # The most time between two looks of a pod's watchdog at its runner's lease.
    watchdog_look_seconds: float = 15.0
    # An idle warm pod looks one poll interval less often for each this long idle.
    warm_idle_slowdown_seconds: float = 5.0
    # How long a warm pod waits for a task's logs and events to reach the API.
    telemetry_seconds: float = 30.0
    # terminationGracePeriodSeconds: GKE's graceful node shutdown gives non-system pods
    # the first 15 s of a Spot VM's 30 s notice, best effort
    # (https://cloud.google.com/kubernetes-engine/docs/concepts/spot-vms).
    termination_grace_seconds: float = 15.0
    # Between a SIGTERM and the pod's own SIGKILL: the emergency checkpoint's window, 5 s
    # before the grace ends so the final state is still written.
    emergency_window_seconds: float = 10.0

    # How long a pod keeps asking the metadata server for its token: under Workload Identity
    # GKE's metadata server does not answer a new pod for its first seconds
    # (https://cloud.google.com/kubernetes-engine/docs/concepts/workload-identity#limitations).
    metadata_wait_seconds: float = 60.0

    # -- local backend ------------------------------------------------------------------
    # How long a local pod template may take to answer a fork request.
    template_reply_seconds: float = 120.0

    # -- environments and the CLI ------------------------------------------------------
    # How long a builder Job may take, pending included (a cold build of a TPU stack).
    build_timeout_seconds: float = 3600.0
    # How often `jobs logs --follow` looks again at a log, pod or task run that has not changed.
    logs_poll_seconds: float = 0.5
    # `doctor`'s test pod: how long it may take, pending included, and how long it is kept.
    doctor_pod_timeout_seconds: float = 300.0
    doctor_pod_ttl_seconds: float = 600.0

    def __post_init__(self) -> None:
        for item in dataclasses.fields(self):
            value = getattr(self, item.name)
            if not _is_number(value) or value <= 0:
                raise ConfigurationError(
                    f"intervals: {item.name}={value!r} is not a positive number of seconds."
                )
            object.__setattr__(self, item.name, float(value))
        if self.emergency_window_seconds >= self.termination_grace_seconds:
            raise ConfigurationError(
                f"intervals: emergency_window_seconds={self.emergency_window_seconds:g} must be "
                f"below termination_grace_seconds={self.termination_grace_seconds:g}: the pod "
                "writes its final state after its emergency checkpoint, before the SIGKILL."
            )

    @classmethod
    def of(cls, *layers: Mapping[str, Any] | Intervals | None) -> Intervals:
        """The defaults with each layer's fields applied in turn (later layers win)."""
        merged: dict[str, Any] = {}
        for layer in layers:
            if layer is None:
                continue
            values = layer.changed() if isinstance(layer, Intervals) else dict(layer)
            _check_names(values)
            merged.update(values)
        return cls(**merged)

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> Intervals:
        """The intervals `KINETIC_INTERVALS` sets (a JSON object), else the defaults."""
        return cls.of(parse_intervals_env(environ.get(INTERVALS_ENV, "")))

    def changed(self) -> dict[str, float]:
        """The fields that differ from the defaults."""
        default = Intervals()
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if getattr(self, f.name) != getattr(default, f.name)
        }

    def to_env(self) -> dict[str, str]:
        """What a pod's manifest carries so the pod uses these intervals (nothing for defaults)."""
        changed = self.changed()
        return {INTERVALS_ENV: json.dumps(changed, sort_keys=True)} if changed else {}


INTERVAL_NAMES = tuple(f.name for f in dataclasses.fields(Intervals))


def parse_intervals_env(value: str) -> dict[str, Any]:
    """The fields a `KINETIC_INTERVALS` value sets; empty for an unset variable."""
    if not value.strip():
        return {}
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as exc:
        raise ConfigurationError(
            f"{INTERVALS_ENV}={value!r} is not JSON: use an object such as "
            "'{\"watchdog_look_seconds\": 5}'."
        ) from exc
    if not isinstance(parsed, dict):
        raise ConfigurationError(
            f"{INTERVALS_ENV} must be a JSON object of interval names to seconds, "
            f"not {type(parsed).__name__}."
        )
    _check_names(parsed)
    return parsed


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _check_names(values: Mapping[str, Any]) -> None:
    unknown = sorted(set(values) - set(INTERVAL_NAMES))
    if unknown:
        hints = []
        for name in unknown:
            close = difflib.get_close_matches(name, INTERVAL_NAMES, n=1)
            hints.append(f"{name} (did you mean {close[0]}?)" if close else name)
        raise ConfigurationError(
            f"Unknown interval(s) {', '.join(hints)}; docs/intervals.md lists them all."
        )
