"""The engine core: LLMEngine -> Scheduler -> BlockManager, and ModelRunner -> model.

config / sampling_params      what to run and how to sample
sequence                      one request: tokens, block table, block keys
free_queue / block_pool       blocks, ref counts, O(1) LRU, key -> block map, KV events
block_manager                 admission with the prefix cache (equality guard, clamping)
scheduler                     continuous batching, chunked prefill, preemption by recompute
model_runner / input_batch    the torch step: inputs, paged attention, logits, sampling
decode_runner / staging       decode steps through fixed buffers (CUDA graphs); one copy a step
paged_attention               attention contexts over block tables (CPU and CUDA)
decode_attention              decode kernels: portable reference, Triton (triton_decode) on CUDA
memory                        KV cache sizing from a profiled maximum-size step
mm_inputs / encoder_cache     image embeddings merged by position, LRU of encoder outputs
hidden_cache / hidden_reads   hidden states kept in the KV slots; what requests read back
sampler / detokenizer         token choice; streaming text with stop strings
lora_adapter / lora_manager   PEFT LoRA adapters read and checked (no torch); their LRU slots
sim_runner                    the `sim` engine's timing model (no torch)
sim_presets                   its step model fitted to figures measured on a device (no torch)
llm_engine                    the synchronous API the worker service drives; `step` is one step
"""
