import localm_missing_dependency_for_tests  # noqa: F401  (the point: this import fails)
