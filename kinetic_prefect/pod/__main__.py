import sys

from kinetic_prefect.pod.exit import FastExit

# Before anything else registers an exit handler, so that its own runs last.
fast_exit = FastExit()

from kinetic_prefect.pod.entrypoint import main  # noqa: E402

fast_exit.code = main()
sys.exit(fast_exit.code)
