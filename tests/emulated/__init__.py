"""The gke backend and GCS: kmock's Kubernetes emulator with the test kubelet, fake-gcs-server."""
