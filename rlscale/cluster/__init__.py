"""Running rlscale on Kubernetes: KubeRay manifests (render) and Ray job submission (jobs)."""
