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

The launcher decides nothing about a task run's state: what it learns (inputs
ready, a pod started, waiting or ended, a launch failed) it posts to the runner's
`RunLoop`, which decides with `run_state.step` and asks the launcher back for the
I/O (launch, adopt, stop a pod). Reading what a pod left is done here, off the
loop, before its end is posted.
"""

from __future__ import annotations

import concurrent.futures
import inspect
import json
from pathlib import Path
from typing import Any

from prefect.logging import get_logger
from prefect.states import Failed, State

from kinetic_prefect.backends.base import Backend, PodExit
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
from kinetic_prefect.runner.attempt_end import AttemptEnd, ask_recorded_runs, read_attempt_end
from kinetic_prefect.runner.reattach import (
    Reattacher,
    identity_labels,
    reattached_state,
    stop_earlier_pod,
)
from kinetic_prefect.runner.resources import RunnerResources
from kinetic_prefect.runner.run_loop import RunLoop
from kinetic_prefect.runner.run_state import (
    Cancel,
    Conclude,
    EngineDecided,
    Event,
    FlowRunOver,
    PodEnded,
    PodPending,
    Prepared,
    Started,
    launch_failed,
    runs_after,
)
from kinetic_prefect.runner.task_launch import Inputs, TaskLaunch
from kinetic_prefect.runner.warm_pods import runs_warm

logger = get_logger("kinetic_prefect.runner.launcher")

CANCELLED_ON_EXIT = "The flow run ended while the task run was not finished."


class Launcher:
    """Takes task runs from submission to a resolved future, through pods."""

    def __init__(self, resources: RunnerResources) -> None:
        self.resources = resources
        self.reattach = Reattacher(resources)
        self.loop = RunLoop(self)

    def post(self, launch: TaskLaunch, event: Event) -> None:
        self.loop.post(launch, event)

    def conclude(self, launch: TaskLaunch, state: State[Any]) -> None:
        """End the task run with `state`, which no pod reported (the runner records it)."""
        self.post(launch, Conclude(state))

    # -- before the pod ---------------------------------------------------------

    def prepare_and_launch(
        self,
        launch: TaskLaunch,
        parameters: dict[str, Any],
        wait_for: Any,
        dependencies: dict[str, set[Any]] | None,
    ) -> None:
        """Resolve upstreams as Prefect's engine does, ship data and code, then post
        `Prepared` (the loop launches the first pod) or the state the run ends with."""
        from prefect.exceptions import UpstreamTaskError
        from prefect.utilities.engine import resolve_inputs_sync

        if self._flow_run_found_over(launch):
            return
        try:
            try:
                # The engine's own resolution (a single future, a list, nested, behind
                # allow_failure): this runner's are done by now; other kinds are waited on here.
                resolve_inputs_sync({"wait_for": wait_for}, return_data=False)
                resolved = resolve_inputs_sync(parameters, return_data=True, max_depth=-1)
            except UpstreamTaskError:
                if launch.cancelled:
                    return
                # NotReady is decided by Prefect's engine itself, before calling the task,
                # so no pod is needed.
                not_ready = prefect_bridge.run_not_ready(
                    launch.task, launch.task_run, parameters, wait_for, dependencies
                )
                self.post(launch, EngineDecided(not_ready))
                return
            if launch.cancelled:
                return
            # A code archive that cannot be shipped is refused before anything is uploaded.
            self.package_code(launch, local_data_paths(resolved))
            settings = launch.settings
            store = open_store(settings.resolved_jobs_root(), settings.gcp_credentials)
            inputs = self.ship_data(launch, store, resolved, dependencies)
            cached = result_check.cached_state(
                launch.task,
                launch.task_run,
                inputs.parameters,
                store,
                self.resources.flow_run_key,
            )
            if cached is not None:
                if cached.is_completed() and not launch.cancelled:
                    prefect_bridge.run_completion_hooks(launch.task, launch.task_run, cached)
                self.post(launch, Prepared(inputs, cached=cached))
                return
            if launch.cancelled:
                return
            # A pod an earlier flow process launched for this task is taken over, not doubled.
            earlier = self.reattach.find(launch, store)
            job_id = earlier.job_id if earlier is not None else launch.job_id
            prefect_bridge.record_output_location(
                launch.task_run, self._location_rows(launch, job_id)
            )
            self.post(launch, Prepared(inputs, earlier=earlier))
        except BaseException as exc:
            logger.debug("Launching %s failed", launch.job_id, exc_info=True)
            self.post(launch, launch_failed("Could not launch the pod", exc))

    def ship_data(
        self,
        launch: TaskLaunch,
        store: JobsStore,
        parameters: dict[str, Any],
        dependencies: dict[str, set[Any]] | None,
    ) -> Inputs:
        """Upload local `Data` once and describe every `Data` as a `DataRef` for the pod."""
        if not data.find_data(parameters):
            return Inputs(
                store=store,
                parameters=parameters,
                dependencies=dependencies,
                local_data_paths=local_data_paths(parameters),
            )
        shipped = ship_parameters(store, parameters, self.resources.data_hashes)
        prefect_bridge.record_data_used(launch.task_run, shipped.rows())
        return Inputs(
            store=store,
            parameters=shipped.parameters,
            dependencies=dependencies,
            data_volumes=shipped.volumes,
            local_data_paths=shipped.local_paths,
            data_bytes_uploaded=shipped.bytes_uploaded,
        )

    def package_code(
        self, launch: TaskLaunch, local_paths: tuple[Path, ...]
    ) -> tuple[Path, CodeArchive]:
        """The task's package root and its code archive (built once per runner).

        Raises `PayloadError`, before any file is read, for a root too broad to ship
        and for an archive past the `code_archive_max_*` limits.
        """
        source = inspect.getsourcefile(launch.task.fn) if hasattr(launch.task, "fn") else None
        explicit = self.resources.package_root
        root = find_package_root(source, explicit)
        check_package_root(root, explicit=bool(explicit))
        limits = ArchiveLimits.of(launch.settings)
        return root, self.resources.context_zip(root, limits, local_paths)

    def _location_rows(self, launch: TaskLaunch, job_id: str) -> dict[str, str]:
        return {
            "accelerator": launch.accelerator.name + (" (spot)" if launch.accelerator.spot else ""),
            "backend": launch.settings.backend,
            "job id": job_id,
            "output dir": launch.output_dir,
        }

    # -- one attempt ------------------------------------------------------------

    def launch_attempt(self, launch: TaskLaunch) -> None:
        """Package, upload and launch one pod for the task run; none once its flow run was
        found over (its lease marked): the run takes that in instead (`FlowRunOver`), as the
        runs that were unfinished when the lease was marked did."""
        if self._flow_run_found_over(launch):
            return
        settings = launch.settings
        jobs_root = settings.resolved_jobs_root()
        inputs = launch.inputs
        assert inputs is not None, "launched before it was prepared"
        store = inputs.store
        root, code = self.package_code(launch, inputs.local_data_paths)
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
            data_volumes=inputs.data_volumes,
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

    def _flow_run_found_over(self, launch: TaskLaunch) -> bool:
        """Whether the lease found the run's flow run over (it is marked): then the run
        takes that in (`FlowRunOver`) instead of being prepared or launched."""
        if self.resources.flow_run_ending(launch) is None:
            return False
        self.loop.post(launch, FlowRunOver(CANCELLED_ON_EXIT))
        return True

    def _package_attempt(self, launch: TaskLaunch, root: Path) -> tuple[bytes, str]:
        """The attempt's payload: its bytes and sha256."""
        inputs = launch.inputs
        assert inputs is not None
        payload = build_payload(
            {
                # The engine in the pod retries exceptions with what is left of the budget,
                # and writes a saved GCS bucket's results without prefect-gcp.
                "task": launch.task.with_options(
                    retries=launch.state.engine_retries,
                    result_storage=PodGcsBucket.standing_in_for(launch.task.result_storage),
                ),
                # Its run count is the runs so far (set by the loop as it launched this).
                "task_run": launch.task_run,
                "parameters": inputs.parameters,
                # Upstreams were resolved here already; the pod needs no futures.
                "wait_for": None,
                "dependencies": inputs.dependencies,
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
            ATTEMPT_ENV: str(launch.state.pods_launched + 1),
            "PYTHONUNBUFFERED": "1",
        }

    def _launch_cold(
        self, launch: TaskLaunch, spec: LaunchSpec, backend: Backend, secrets: PodSecrets
    ) -> None:
        """Hand the attempt's Job (and, for a slice, its Service) to the backend."""
        workload = build_workload(spec)
        job_id = spec.job_id
        if launch.cancelled:
            return
        # Posted first: whatever the pod does next is posted after it.
        self.post(launch, Started(job_id, backend, workload.job))
        backend.launch(
            workload.job,
            on_exit=lambda outcome: launch.in_context(self.on_pod_exit, launch, outcome),
            secrets=secrets.contents(),
            on_pending=lambda reason: launch.in_context(self.on_pod_pending, launch, reason),
            extra_objects=workload.extra_objects,
        )
        if launch.cancelled:
            # Cancelled while the Job was being created: the cancel may have missed it.
            backend.cancel(job_id)

    def adopt(self, launch: TaskLaunch, job_id: str) -> None:
        """Watch a pod an earlier flow process launched for this task run, as if launched here."""
        assert launch.backend is not None and launch.inputs is not None
        # From now on this process renews the flow run's lease, so the pod lives on.
        self.resources.lease_env(launch, launch.inputs.store)
        logger.info(
            "Task run %s: reattaching to pod %s, launched by an earlier flow process",
            launch.task_run.name,
            job_id,
        )
        launch.backend.adopt(
            job_id,
            launch.settings.namespace,
            on_exit=lambda outcome: launch.in_context(self.on_pod_exit, launch, outcome),
            on_pending=lambda reason: launch.in_context(self.on_pod_pending, launch, reason),
        )

    def stop_pod(self, launch: TaskLaunch, job_id: str) -> None:
        """Stop the task run's pod: taken from the warm pool, or its Job cancelled."""
        if not self.resources.warm_pods.cancel(launch) and launch.backend is not None:
            launch.backend.cancel(job_id)

    def stop_earlier(self, launch: TaskLaunch, job_id: str) -> None:
        """Stop a live pod of an earlier flow process that this ended run never took over."""
        assert launch.backend is not None
        logger.info(
            "Task run %s ended before reattaching to pod %s of an earlier flow process: "
            "stopping that pod",
            launch.task_run.name,
            job_id,
        )
        stop_earlier_pod(launch.backend, launch.settings.namespace, job_id)

    def on_pod_pending(self, launch: TaskLaunch, reason: str) -> None:
        """Show why the pod is not running yet as the task run's Pending message."""
        self.post(launch, PodPending(launch.job_id, reason))

    # -- how an attempt ends (read here, off the loop) -------------------------------

    def on_pod_exit(self, launch: TaskLaunch, outcome: PodExit) -> None:
        """Read what the ended pod left and post it (the loop decides what follows)."""
        state = launch.state
        if outcome.job_id != state.job_id:
            return
        next_job_id = make_job_id(launch.task.name)
        if state.done and state.final is not None:
            # A late pod: nothing to read, the runner's word is recorded again. (From the
            # state, not the future: this may run before the loop has resolved it.)
            late = AttemptEnd(state.final, reported_by_pod=False)
            self.post(launch, PodEnded(outcome.job_id, late, next_job_id))
            return
        assert launch.inputs is not None
        store = launch.inputs.store
        try:
            end = read_attempt_end(
                store, outcome.job_id, outcome, self.resources.signing_key(launch)
            )
        except Exception as exc:
            logger.exception("Reading the final state of %s failed", outcome.job_id)
            message = f"Could not read the pod's final state: {exc}"
            unread = AttemptEnd(Failed(message=message, data=exc), reported_by_pod=False)
            self.post(launch, PodEnded(outcome.job_id, unread, next_job_id, unreadable=True))
            return
        if state.adopted and end.reported_by_pod and end.state.is_completed():
            end = AttemptEnd(reattached_state(end.state, outcome.job_id), reported_by_pod=True)
        recorded_runs, delay, stopped = 0, end.retry_delay(), bool(outcome.cancelled)
        if not end.reported_by_pod:
            if ask_recorded_runs(
                retries=launch.task.retries,
                crashed=end.state.is_crashed(),
                preempted=bool(outcome.preempted),
                hosts=launch.accelerator.hosts,
            ):
                recorded_runs = prefect_bridge.recorded_run_count(launch.task_run.id)
            delay = prefect_bridge.retry_delay(launch.task, runs_after(state, recorded_runs))
            # A flow run the lease marked over (its pods end themselves on SIGTERM, which
            # looks like a preemption) is never relaunched.
            stopped = stopped or self.resources.flow_run_ending(launch) is not None
        self.post(
            launch,
            PodEnded(
                outcome.job_id,
                end,
                next_job_id,
                preempted=outcome.preempted,
                stopped=stopped,
                recorded_runs=recorded_runs,
                retry_delay=delay,
                task_run=end.task_run,
            ),
        )

    # -- cancelling ---------------------------------------------------------------

    def cancel_many(self, launches: list[TaskLaunch], message: str = CANCELLED_ON_EXIT) -> None:
        """Cancel several task runs at once, and return once each is recorded `Cancelled`
        and its pod asked to stop (at once when called on the loop or its I/O threads,
        which would otherwise wait for themselves).

        The loop marks every one before it resolves any: a downstream woken by its
        upstream's cancel then sees its own and starts nothing (no NotReady, no pod).
        """
        self.loop.post_many((launch, Cancel(message)) for launch in launches)
        if self.loop.runs_on_current_thread():
            return
        concurrent.futures.wait([launch.future for launch in launches])
        self.loop.wait_for_io()

    def flow_run_over(self, launches: list[TaskLaunch]) -> None:
        """The lease found the task runs' flow run over: each takes it in (`FlowRunOver`),
        and this returns once all have, before the lease is marked for the pods to read."""
        self.loop.post_many((launch, FlowRunOver(CANCELLED_ON_EXIT)) for launch in launches)
        self.loop.settle()

    def cancel(self, launch: TaskLaunch, message: str = CANCELLED_ON_EXIT) -> None:
        """Stop the task run: no further pod, the running one stopped, the future Cancelled."""
        self.cancel_many([launch], message)

    def open(self) -> None:
        """Take work again after `close` (a runner entered again)."""
        self.resources.warm_pods.open()
        self.loop.open()

    def close(self) -> None:
        """Close the backends (their pods' last events are applied), then the loop."""
        try:
            self.resources.close()
        finally:
            self.loop.close()
