"""Runtime code every kernel shares; the build vendors it into each package as `_shared`."""
