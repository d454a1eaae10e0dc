"""Prompts of mixed lengths, two sharing a long prefix: the workload of the parity tests."""

PREFIX = "Tensor parallelism splits each weight matrix across several devices; an all-reduce sums the results. "
PARITY_PROMPTS = [
    "Hello",
    "The quick brown fox jumps over the lazy dog. A language model reads a prompt",
    "def fibonacci(n: int) -> list[int]:",
    "Once upon a time there was a small model that wanted to learn. It read books about the sea, the stars and",
    PREFIX + "What is the capital of France?",
    PREFIX + "Write a short poem about the ocean.",
    "1 2 3",
]
