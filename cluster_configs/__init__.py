"""Cluster and serving configs; `models/` holds model presets (installed as package data)."""
