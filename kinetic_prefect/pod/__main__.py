import gc
import sys

# Until its task starts (`runner.run_task`) the pod imports and unpickles: Prefect alone
# builds some hundred thousand objects, and the collector's passes over them cost about
# a tenth of the start-up.
gc.disable()

from kinetic_prefect.pod.exit import FastExit  # noqa: E402

# Before anything else registers an exit handler, so that its own runs last.
fast_exit = FastExit()

from kinetic_prefect.pod.entrypoint import main  # noqa: E402

fast_exit.code = main()
sys.exit(fast_exit.code)
