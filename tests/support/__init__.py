"""What tests share, in one place (no tests here):

- chat: chat bodies and one POST (JSON or raw bytes); waits: waiting for a gateway to sync, for
  a condition on an event loop, for a server to answer; images, metrics, processes, paths;
- worker_harness: a real `python -m worker` process; engine: an in-process LLMEngine;
- vllm_like: a vLLM-shaped server (HTTP and KV events); vllm_fleet: real vLLM servers (`-m vllm`);
- k8s_fake_api, discovery: a Kubernetes API server on 127.0.0.1 and what discovery emits;
- epp: an endpoint picker process; service_front: a kube-proxy-like Service for rollouts;
- image_server: a malicious image server; json_bombs: element-heavy bodies and their cost;
- lora_fixtures: a tiny transformers Llama and PEFT adapters of it;
- bench_runs: a bench/ script run as its user runs it (tests never import bench).

Blocking waits on a condition are `harness.cluster.wait_until`, shared with the benchmarks.
"""
