"""Demo checkpoints, generated, never downloaded: the model `--model demo` serves (model.py, with
its tokenizer, tokenizer.py), its LoRA adapters (lora.py) and a hybrid sliding-window model for
real vLLM (hybrid.py). Byte-identical on every run; numpy and safetensors, never torch, so the
gateway's tests and benchmarks write them too.
"""
