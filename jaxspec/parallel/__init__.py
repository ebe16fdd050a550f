"""Parallelism: device meshes (sharding), multi-process runs, weight offloading."""
