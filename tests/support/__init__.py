"""What tests share, in one place (no tests here):

- waits, processes, paths, metrics: waits and readings most tests need;
- worker_harness: a real `python -m worker` process; engine: an in-process LLMEngine;
- vllm_like: a vLLM-shaped server (HTTP and KV events); vllm_fleet: real vLLM servers (`-m vllm`);
- k8s_fake_api, discovery: a Kubernetes API server on 127.0.0.1 and what discovery emits;
- epp: an endpoint picker process; service_front: a kube-proxy-like Service for rollouts;
- image_server: a malicious image server; json_bombs: element-heavy bodies and their cost;
- lora_fixtures: a tiny transformers Llama with PEFT adapters.
"""
