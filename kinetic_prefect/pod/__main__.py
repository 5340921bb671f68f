import sys

from kinetic_prefect.pod.runner import main

sys.exit(main())
