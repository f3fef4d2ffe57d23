"""Tests of worker/engine/: scheduler, block manager, runners, kernels, sampling, LoRA."""
