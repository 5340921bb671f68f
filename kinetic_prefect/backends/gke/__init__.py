"""The gke backend: Jobs on GKE through kubernetes-asyncio, one watch for every job."""
