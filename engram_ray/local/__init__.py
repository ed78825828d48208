"""The local deployment and its tools: the deployment (`deployment`), a Prometheus runner
(`prometheus`), load generator (`loadgen`), faults (`faults`), probes, warm-up, `vllm bench`."""
