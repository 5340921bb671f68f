import gc
import sys

# Until the task's inputs are unpickled the pod only imports and unpickles; the collector
# starts then (`runner.start_collecting`).
gc.disable()

from kinetic_prefect.pod.exit import FastExit  # noqa: E402

# Before anything else registers an exit handler, so that its own runs last.
fast_exit = FastExit()

from kinetic_prefect.pod.entrypoint import main  # noqa: E402

fast_exit.code = main()
sys.exit(fast_exit.code)
