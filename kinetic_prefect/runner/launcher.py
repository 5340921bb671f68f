"""One task run on its way through pods: upstreams, data, package, launch, and how it ends.

`Launcher` owns everything between `KineticTaskRunner.submit()` and a resolved
future: it resolves upstream futures exactly as Prefect's engine would (the runner
parks a submission until the futures it can watch are done), ships
`Data`, packages the task, launches one Job per attempt through a backend, and
turns the pod's report (or its silent death) into the future's state.

Retries follow Prefect's engine: an exception inside the task is retried by the
engine in the pod (so the task run's history is Prefect's own: no terminal
state for an attempt that is retried). On a multi-host slice the engine runs
one attempt and records the retry it decides on; the runner then relaunches
every host, so all hosts are always in the same attempt. A pod that dies without reporting is
the runner's business: while the task has retries left it is recorded as
`AwaitingRetry` with the reason and relaunched for the same task run, with the
same `KINETIC_OUTPUT_DIR`, so it resumes from its checkpoint.

Every future is resolved exactly once (`TaskLaunch.resolve`), whichever of the
watcher, the submitter or a cancel gets there first.

A state the runner records as final is the task run's last word. Prefect keeps
the state with the latest timestamp, and a pod being stopped may still record
one (`Running`, as its engine starts; `Crashed`, as the stop interrupts it)
after the runner wrote `Cancelled`. So once that pod has exited, and whenever
the engine here decided `NotReady` while a cancel was being recorded, the
runner's final state is recorded again (`Launcher.reassert_final`).
"""

from __future__ import annotations

import inspect
import json
import threading
from pathlib import Path
from typing import Any

from prefect.logging import get_logger
from prefect.states import Cancelled, Failed, Pending, State

from kinetic_prefect.backends.base import Backend, PodExit, pending_message
from kinetic_prefect.backends.environments import ready_environment
from kinetic_prefect.common import layout, versions
from kinetic_prefect.common.env import (
    ATTEMPT_ENV,
    CLIENT_VERSIONS_ENV,
    NODE_CACHE_KEY_ENV,
    SIGNING_KEY_ENV,
)
from kinetic_prefect.common.handover import INLINE_PAYLOAD_BYTES
from kinetic_prefect.common.prefect_pod_storage import PodGcsBucket
from kinetic_prefect.common.storage import JobsStore, open_store
from kinetic_prefect.data import data
from kinetic_prefect.errors import PodPhaseError, PodStartError
from kinetic_prefect.launch import prefect_context
from kinetic_prefect.launch.manifest import LaunchSpec
from kinetic_prefect.launch.manifest import new_job_id as make_job_id
from kinetic_prefect.launch.packaging import (
    ArchiveLimits,
    CodeArchive,
    build_payload,
    check_package_root,
    find_package_root,
    import_paths_under,
    payload_size_warning,
    upload_context,
)
from kinetic_prefect.launch.pod_secrets import PodSecrets, split_env
from kinetic_prefect.launch.shipping import local_data_paths, ship_parameters
from kinetic_prefect.launch.slices import build_workload
from kinetic_prefect.runner import prefect_engine as prefect_bridge
from kinetic_prefect.runner import result_check
from kinetic_prefect.runner.attempt_end import (
    RELAUNCH_PREEMPTED,
    RETRY,
    after_silent_end,
    concluded_state,
    exception_or_none,
    read_attempt_end,
)
from kinetic_prefect.runner.reattach import Reattacher, identity_labels
from kinetic_prefect.runner.resources import RunnerResources
from kinetic_prefect.runner.task_launch import TaskLaunch
from kinetic_prefect.runner.warm_pods import runs_warm

logger = get_logger("kinetic_prefect.runner.launcher")

CANCELLED_ON_EXIT = "The flow run ended while the task run was not finished."


class Launcher:
    """Takes task runs from submission to a resolved future, through pods."""

    def __init__(self, resources: RunnerResources) -> None:
        self.resources = resources
        self.reattach = Reattacher(resources)

    # -- before the pod ---------------------------------------------------------

    def prepare_and_launch(
        self,
        launch: TaskLaunch,
        parameters: dict[str, Any],
        wait_for: Any,
        dependencies: dict[str, set[Any]] | None,
    ) -> None:
        """Resolve upstreams as Prefect's engine does, then launch the first pod."""
        from prefect.exceptions import UpstreamTaskError
        from prefect.utilities.engine import resolve_inputs_sync

        launch.dependencies = dependencies
        try:
            try:
                # The engine's own resolution (a single future, a list, nested, behind
                # allow_failure): this runner's are done by now; other kinds are waited on here.
                resolve_inputs_sync({"wait_for": wait_for}, return_data=False)
                resolved = resolve_inputs_sync(parameters, return_data=True, max_depth=-1)
            except UpstreamTaskError:
                if not launch.cancelled:
                    # NotReady is decided by Prefect's engine itself, before calling the
                    # task, so no pod is needed.
                    not_ready = prefect_bridge.run_not_ready(
                        launch.task, launch.task_run, parameters, wait_for, dependencies
                    )
                    if not launch.resolve(not_ready):
                        # A cancel was recorded while the engine recorded NotReady.
                        self.reassert_final(launch)
                return
            if launch.cancelled:
                return
            # A code archive that cannot be shipped is refused before anything is uploaded.
            launch.local_data_paths = local_data_paths(resolved)
            self.package_code(launch)
            launch.parameters = self.ship_data(launch, resolved)
            launch.store = launch.store or open_store(
                launch.settings.resolved_jobs_root(), launch.settings.gcp_credentials
            )
            cached = result_check.cached_state(
                launch.task,
                launch.task_run,
                resolved,
                launch.store,
                self.resources.flow_run_key,
            )
            if cached is not None:
                self.conclude(launch, cached)
                return
            if launch.cancelled:
                return
            # A pod an earlier flow process launched for this task is taken over, not doubled.
            attached = self.reattach.attach(self, launch)
            prefect_bridge.record_output_location(launch.task_run, self._location_rows(launch))
            if not attached:
                self.launch_attempt(launch)
        except BaseException as exc:
            logger.debug("Launching %s failed", launch.job_id, exc_info=True)
            self.conclude(launch, Failed(message=f"Could not launch the pod: {exc}", data=exc))

    def ship_data(self, launch: TaskLaunch, parameters: dict[str, Any]) -> dict[str, Any]:
        """Upload local `Data` once and describe every `Data` as a `DataRef` for the pod."""
        if not data.find_data(parameters):
            return parameters
        store = launch.store or open_store(
            launch.settings.resolved_jobs_root(), launch.settings.gcp_credentials
        )
        launch.store = store
        shipped = ship_parameters(store, parameters, self.resources.data_hashes)
        launch.data_volumes = shipped.volumes
        launch.local_data_paths = shipped.local_paths
        launch.data_bytes_uploaded += shipped.bytes_uploaded
        prefect_bridge.record_data_used(launch.task_run, shipped.rows())
        return shipped.parameters

    def package_code(self, launch: TaskLaunch) -> tuple[Path, CodeArchive]:
        """The task's package root and its code archive (built once per runner).

        Raises `PayloadError`, before any file is read, for a root too broad to ship
        and for an archive past the `code_archive_max_*` limits.
        """
        source = inspect.getsourcefile(launch.task.fn) if hasattr(launch.task, "fn") else None
        explicit = self.resources.package_root
        root = find_package_root(source, explicit)
        check_package_root(root, explicit=bool(explicit))
        limits = ArchiveLimits.of(launch.settings)
        return root, self.resources.context_zip(root, limits, launch.local_data_paths)

    def _location_rows(self, launch: TaskLaunch) -> dict[str, str]:
        return {
            "accelerator": launch.accelerator.name + (" (spot)" if launch.accelerator.spot else ""),
            "backend": launch.settings.backend,
            "job id": launch.job_id,
            "output dir": launch.output_dir,
        }

    # -- one attempt ------------------------------------------------------------

    def launch_attempt(self, launch: TaskLaunch) -> None:
        """Package, upload and launch one pod for the task run."""
        settings = launch.settings
        jobs_root = settings.resolved_jobs_root()
        store = launch.store or open_store(jobs_root, settings.gcp_credentials)
        launch.store = store
        root, code = self.package_code(launch)
        backend = self.resources.backend_for(settings, jobs_root)
        environment = None
        if settings.ships_environment():
            environment = ready_environment(
                settings,
                launch.attempt_accelerator(),
                root,
                open_store(settings.resolved_environment_store(), settings.gcp_credentials),
                backend,
            )
        accelerator = launch.attempt_accelerator()
        # A small payload for a warm pod goes in its assignment, or up if it starts a pod.
        payload, payload_sha256 = self._package_attempt(launch, root)
        payload_key = layout.job_file(launch.job_id, layout.PAYLOAD_FILE)
        if runs_warm(launch, accelerator) and len(payload) <= INLINE_PAYLOAD_BYTES:
            payload_uri, unsent = store.uri(payload_key), payload
        else:
            payload_uri, unsent = store.put_bytes(payload_key, payload), None
        secrets = self._pod_secrets(launch)
        spec = LaunchSpec(
            job_id=launch.job_id,
            task_name=launch.task.name,
            task_run_id=str(launch.task_run.id),
            flow_run_id=str(launch.task_run.flow_run_id) if launch.task_run.flow_run_id else None,
            accelerator=accelerator,
            image=settings.resolved_image(),
            namespace=settings.namespace,
            payload_uri=payload_uri,
            payload_sha256=payload_sha256,
            context_uri=upload_context(store, code),
            context_sha256=code.sha256,
            job_dir_uri=store.uri(layout.job_dir(launch.job_id)),
            output_dir=launch.output_dir,
            env=self._pod_env(launch, store),
            secret_env=secrets.refs(),
            timeout_seconds=settings.timeout_seconds,
            ttl_seconds_after_finished=settings.ttl_seconds_after_finished,
            intervals=settings.intervals,
            node_cache_max_gb=settings.node_cache_max_gb,
            service_account=settings.service_account,
            data_volumes=launch.data_volumes,
            extra_labels=identity_labels(launch),
            environment=environment,
            cpu=settings.cpu,
            memory=settings.memory,
            pod_overrides=settings.pod_overrides,
            queue_name=settings.queue_name,
            queued_provisioning=settings.queued_provisioning,
            job_labels=settings.job_labels,
            job_annotations=settings.job_annotations,
        )
        if self.resources.warm_pods.take(launch, spec, backend, store, secrets, self, unsent):
            return
        self._launch_cold(launch, spec, backend, secrets)

    def _package_attempt(self, launch: TaskLaunch, root: Path) -> tuple[bytes, str]:
        """The attempt's payload: its bytes and sha256."""
        launch.task_run.run_count = launch.runs_used
        payload = build_payload(
            {
                # The engine in the pod retries exceptions with what is left of the budget,
                # and writes a saved GCS bucket's results without prefect-gcp.
                "task": launch.task.with_options(
                    retries=launch.engine_retries,
                    result_storage=PodGcsBucket.standing_in_for(launch.task.result_storage),
                ),
                "task_run": launch.task_run,
                "parameters": launch.parameters,
                # Upstreams were resolved here already; the pod needs no futures.
                "wait_for": None,
                "dependencies": launch.dependencies,
                "context": launch.serialized_context,
                "versions": versions.fingerprint(),
                # Where the shipped code lives here: the pod maps its file names for tracebacks.
                "source_root": str(root),
                # Folders below the root this process imports from: the pod imports from them too.
                "import_paths": import_paths_under(root),
            },
            root,
        )
        warning = payload_size_warning(launch.task.name, payload)
        if warning:
            logger.warning(warning)
        return payload.data, payload.sha256

    def _pod_secrets(self, launch: TaskLaunch) -> PodSecrets:
        """Prefect's secret settings, the user's secret env and the keys: one Secret."""
        _, user_secrets = split_env(launch.settings.env)
        return PodSecrets(
            {
                **prefect_context.secret_values(),
                **user_secrets,
                SIGNING_KEY_ENV: self.resources.signing_key(launch),
                NODE_CACHE_KEY_ENV: self.resources.node_cache_key(),
            }
        )

    def _pod_env(self, launch: TaskLaunch, store: JobsStore) -> dict[str, str]:
        """The pod's plain env: Prefect's allowed settings, the lease, the user's, the attempt's."""
        plain_env, _ = split_env(launch.settings.env)
        return {
            **prefect_context.pod_settings_env(),
            **self.resources.lease_env(launch, store),
            **plain_env,
            CLIENT_VERSIONS_ENV: json.dumps(versions.fingerprint(), sort_keys=True),
            ATTEMPT_ENV: str(launch.pods_launched + 1),
            "PYTHONUNBUFFERED": "1",
        }

    def _launch_cold(
        self, launch: TaskLaunch, spec: LaunchSpec, backend: Backend, secrets: PodSecrets
    ) -> None:
        """Hand the attempt's Job (and, for a slice, its Service) to the backend."""
        workload = build_workload(spec)
        launch.manifest = workload.job
        job_id = launch.job_id
        with launch.lock:
            if launch.cancelled:
                return
            launch.backend = backend
            launch.pods_launched += 1
        backend.launch(
            launch.manifest,
            on_exit=lambda outcome: launch.in_context(self.on_pod_exit, launch, outcome),
            secrets=secrets.contents(),
            on_pending=lambda reason: launch.in_context(self.on_pod_pending, launch, reason),
            extra_objects=workload.extra_objects,
        )
        if launch.cancelled:
            # Cancelled while the Job was being created: the cancel may have missed it.
            backend.cancel(job_id)

    def on_pod_pending(self, launch: TaskLaunch, reason: str) -> None:
        """Show why the pod is not running yet as the task run's Pending message."""
        if launch.future.done():
            return
        prefect_bridge.report_state(
            launch.task_run, Pending(message=pending_message(launch.job_id, reason))
        )

    # -- how an attempt ends (the backend's watcher thread) -----------------------

    def on_pod_exit(self, launch: TaskLaunch, outcome: PodExit) -> None:
        if outcome.job_id != launch.job_id:
            return
        if launch.future.done():
            # Whatever the pod recorded while it was being stopped is older than this.
            self.reassert_final(launch)
            return
        assert launch.store is not None
        try:
            end = read_attempt_end(
                launch.store, launch.job_id, outcome, self.resources.signing_key(launch)
            )
        except Exception as exc:
            logger.exception("Reading the final state of %s failed", launch.job_id)
            self.conclude(
                launch, Failed(message=f"Could not read the pod's final state: {exc}", data=exc)
            )
            return
        if end.reported_by_pod:
            if end.task_run is not None:
                launch.task_run = end.task_run
            if end.retrying:
                launch.runs_used += 1
                note = f"Relaunching every host of the slice: {end.state.message or 'retry'}"
                self.schedule_relaunch(launch, note, end.retry_delay(), recorded=True)
                return
            launch.resolve(end.state)
            return
        launch.runs_used += 1
        if launch.task.retries and end.state.is_crashed() and not outcome.preempted:
            # The pod may have run the task more than once (the engine's retries): ask
            # the API, only when a relaunch depends on it.
            recorded = prefect_bridge.recorded_run_count(launch.task_run.id)
            launch.runs_used = max(launch.runs_used, recorded)
        # A flow run the lease marked over (its pods end themselves on SIGTERM, which
        # looks like a preemption) is never relaunched.
        cancelled = (
            launch.cancelled
            or outcome.cancelled
            or self.resources.flow_run_ending(launch) is not None
        )
        step = after_silent_end(
            state_type=end.state.type,
            cancelled=cancelled,
            preempted=outcome.preempted,
            preemptions_left=launch.preemptions_left,
            retries_left=launch.retries_left,
            pod_never_ran_the_task=isinstance(
                exception_or_none(end.state), (PodPhaseError, PodStartError)
            ),
        )
        if step == RELAUNCH_PREEMPTED:
            launch.preemptions += 1
            note = (
                f"Preempted: {end.state.message} (preemption {launch.preemptions} of "
                f"{launch.settings.preemption_retries}; the task's retries are untouched)"
            )
            self.schedule_relaunch(launch, note, delay=0.0)
        elif step == RETRY:
            delay = prefect_bridge.retry_delay(launch.task, launch.runs_used)
            self.schedule_relaunch(launch, f"Retrying after a crash: {end.state.message}", delay)
        else:
            self.conclude(launch, concluded_state(end.state, cancelled))

    def schedule_relaunch(
        self, launch: TaskLaunch, note: str, delay: float, recorded: bool = False
    ) -> None:
        """Record AwaitingRetry with the reason (unless the pod `recorded` its retry state);
        wait out the delay without a pod."""
        if not recorded:
            prefect_bridge.report_state(launch.task_run, prefect_bridge.awaiting_retry(delay, note))
        launch.job_ids.append(make_job_id(launch.task.name))
        logger.info(
            "Task run %s: %s; relaunching as %s in %.1fs",
            launch.task_run.name,
            note,
            launch.job_id,
            delay,
        )

        def relaunch() -> None:
            if launch.cancelled:
                return
            try:
                self.launch_attempt(launch)
            except BaseException as exc:
                self.conclude(
                    launch, Failed(message=f"Could not relaunch the pod: {exc}", data=exc)
                )

        timer = threading.Timer(delay, launch.in_context, args=(relaunch,))
        timer.daemon = True
        launch.retry_timer = timer
        timer.start()

    def conclude(self, launch: TaskLaunch, state: State[Any]) -> None:
        """Report a state no pod reported, and resolve the future with it (once)."""
        with launch.lock:
            if launch.future.done():
                return
            try:
                prefect_bridge.report_state(launch.task_run, state)
            except Exception:
                logger.warning(
                    "Could not report %s for %s", state.type.value, launch.job_id, exc_info=True
                )
            launch.recorded_final = state
            launch.future.set_result(state)

    def reassert_final(self, launch: TaskLaunch) -> None:
        """Record the runner's final state again, now, so that it outlasts anything older.

        No-op unless the runner resolved the task run itself (a pod's own report
        stands as the pod recorded it).
        """
        with launch.lock:
            state = launch.recorded_final
            if state is None:
                return
            again = state.fresh_copy()
            launch.recorded_final = again
            try:
                launch.in_context(prefect_bridge.report_state, launch.task_run, again)
            except Exception:
                logger.warning(
                    "Could not record %s again for %s",
                    state.type.value,
                    launch.job_id,
                    exc_info=True,
                )

    # -- cancelling ---------------------------------------------------------------

    def cancel_many(self, launches: list[TaskLaunch], message: str = CANCELLED_ON_EXIT) -> None:
        """Cancel several task runs, none of them started by another's cancel.

        Every one is marked first: a downstream woken by its upstream's cancel then
        sees its own and starts nothing (no NotReady, no pod).
        """
        for launch in launches:
            with launch.lock:
                launch.cancelled = True
        for launch in launches:
            self.cancel(launch, message)

    def cancel(self, launch: TaskLaunch, message: str = CANCELLED_ON_EXIT) -> None:
        """Stop the task run: no further pod, the running one cancelled, the future Cancelled."""
        with launch.lock:
            launch.cancelled = True
            backend = launch.backend
        if launch.retry_timer is not None:
            launch.retry_timer.cancel()
        if not self.resources.warm_pods.cancel(launch) and backend is not None:
            try:
                backend.cancel(launch.job_id)
            except Exception:
                logger.warning("Could not cancel pod %s", launch.job_id, exc_info=True)
        launch.in_context(self.conclude, launch, Cancelled(message=message))
