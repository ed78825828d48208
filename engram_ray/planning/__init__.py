"""Pure planning: memory per GPU (`memory`), slice assignment (`assignment`), NVLink topology
(`topology`), peer-group grouping (`grouping`), group generations (`generations`)."""
