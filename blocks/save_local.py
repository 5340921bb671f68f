"""Save the local block set: a `KineticCluster` named `local` (pods are local processes).

    python blocks/save_local.py [--jobs-dir .kinetic]

Then: `KineticTaskRunner(cluster="local")`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kinetic_prefect.blocks import KineticCluster


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--name", default="local")
    parser.add_argument("--jobs-dir", default=".kinetic")
    args = parser.parse_args()
    jobs_dir = str(Path(args.jobs_dir).absolute())
    KineticCluster(backend="local", jobs_bucket=jobs_dir).save(args.name, overwrite=True)
    print(f"Saved KineticCluster {args.name!r}: local pods, artifacts and outputs in {jobs_dir}")


if __name__ == "__main__":
    main()
