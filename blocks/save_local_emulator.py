"""Save local pods with GCS emulator storage: result storage and artifacts in fake-gcs-server.

    STORAGE_EMULATOR_HOST=http://127.0.0.1:4443 python blocks/save_local_emulator.py

Saves a `GcsBucket` block `local-emulator-results` (with `KineticGcpCredentials`,
anonymous in emulator mode) and a `KineticCluster` block `local-emulator` whose
jobs bucket (`kinetic-jobs`) and result storage (`kinetic-results`) live in the
emulator. Buckets are created if missing. Then, with the same STORAGE_EMULATOR_HOST:

    KINETIC_CLUSTER=local-emulator python flows/quickstart.py
"""

from __future__ import annotations

import argparse
import sys

from prefect_gcp.cloud_storage import GcsBucket

from kinetic_prefect.blocks import KineticCluster, KineticGcpCredentials
from kinetic_prefect.common import gcs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--name", default="local-emulator")
    parser.add_argument("--jobs-bucket", default="kinetic-jobs")
    parser.add_argument("--results-bucket", default="kinetic-results")
    args = parser.parse_args()
    if not gcs.emulator_host():
        sys.exit("Set STORAGE_EMULATOR_HOST=http://HOST:PORT (fake-gcs-server) first.")
    client = gcs.storage_client()
    for bucket in (args.jobs_bucket, args.results_bucket):
        if not client.bucket(bucket).exists():
            client.create_bucket(bucket)
    results_name = f"{args.name}-results"
    GcsBucket(
        bucket=args.results_bucket, bucket_folder="results", gcp_credentials=KineticGcpCredentials()
    ).save(results_name, overwrite=True)
    KineticCluster(
        backend="local",
        jobs_bucket=f"gs://{args.jobs_bucket}",
        result_storage=GcsBucket.load(results_name),
    ).save(args.name, overwrite=True)
    print(f"Saved GcsBucket {results_name!r} and KineticCluster {args.name!r} (emulator).")


if __name__ == "__main__":
    main()
