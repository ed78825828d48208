"""Where a deployment runs and what it is checked against: the Serve, `ray up` and KubeRay files
(`cluster_configs`, `store_sharing`: where `peer_group_store` must be shared; `cluster_fit`: a
Serve YAML's groups against its cluster file; `metrics_ports`: a RayService's ports against its
containers and PodMonitors) and a group placed
again in another NVLink domain when its own is lost (`group_placement`).

Imports: of `engram_ray.serve`, this room and `settings` only.
"""
