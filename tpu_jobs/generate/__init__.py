"""Generation: the samplers (the continuous-batching engine, the static reference sampler,
vLLM), their decode steps and paged KV cache, multi-turn episodes, and the one
sample -> decode -> verify loop of every role that samples. Library code: no job lives
here."""
