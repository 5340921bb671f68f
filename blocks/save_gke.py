"""Save an example GKE block set: result storage on GCS and a `KineticCluster` named `gke`.

    python blocks/save_gke.py --project my-project --zone us-central2-b \
        --cluster ml-cluster --jobs-bucket my-kinetic-jobs --results-bucket my-results

Credentials: the blocks hold none; the orchestrator uses Application Default
Credentials and pods use Workload Identity (see deployments/ for the service
account). Pass --service-account-file to have the orchestrator act as that key's
account instead (not recommended): it goes on the cluster block only, never on the
result storage block, which pods load.
"""

from __future__ import annotations

import argparse

from prefect_gcp.cloud_storage import GcsBucket

from kinetic_prefect.blocks import KineticCluster, KineticGcpCredentials


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--name", default="gke")
    parser.add_argument("--project", required=True)
    parser.add_argument("--zone")
    parser.add_argument("--region")
    parser.add_argument("--cluster", required=True)
    parser.add_argument("--namespace", default="default")
    parser.add_argument("--jobs-bucket", required=True)
    parser.add_argument("--results-bucket", required=True)
    parser.add_argument(
        "--image",
        help="Your own image with every dependency (environment='image'); without it, pods "
        "start from python:3.X-slim and the task's environment ships with it",
    )
    # The task pods' account that deployments/k8s/rbac.yaml creates.
    parser.add_argument("--kubernetes-service-account", default="kinetic-prefect-pods")
    parser.add_argument("--service-account-file")
    args = parser.parse_args()
    results_name = f"{args.name}-results"
    GcsBucket(
        bucket=args.results_bucket,
        bucket_folder="results",
        gcp_credentials=KineticGcpCredentials(project=args.project),
    ).save(results_name, overwrite=True)
    KineticCluster(
        backend="gke",
        project=args.project,
        zone=args.zone,
        region=args.region,
        cluster_name=args.cluster,
        namespace=args.namespace,
        jobs_bucket=f"gs://{args.jobs_bucket}",
        result_storage=GcsBucket.load(results_name),
        gcp_credentials=KineticGcpCredentials(
            project=args.project, service_account_file=args.service_account_file
        ),
        container_image=args.image,
        environment="image" if args.image else None,
        service_account=args.kubernetes_service_account,
    ).save(args.name, overwrite=True)
    print(f"Saved GcsBucket {results_name!r} and KineticCluster {args.name!r}.")


if __name__ == "__main__":
    main()
