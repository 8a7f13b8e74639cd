"""The DDTree core: pure functions over tensors (build, verify layout, acceptance, compaction)."""
