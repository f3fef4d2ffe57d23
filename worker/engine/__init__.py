"""The engine core: LLMEngine -> Scheduler -> BlockManager, and ModelRunner -> model."""
