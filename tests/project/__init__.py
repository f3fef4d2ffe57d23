"""Rules over the repository as a whole: imports, locks, the release workflow, command lines."""
