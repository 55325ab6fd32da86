"""Random-weight presets for tests and benchmarks (plain data: `asynct --help` lists them
without importing torch)."""

# `bench-0.6b` is the shape of the speed benchmarks (benchmarks/RESULTS.md).
PRESETS = {
    "tiny": dict(vocab_size=259, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 max_position_embeddings=2048, tie_word_embeddings=False, torch_dtype="float32"),
    "small": dict(vocab_size=259, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=4, head_dim=32,
                  max_position_embeddings=4096, tie_word_embeddings=True, torch_dtype="bfloat16"),
    "bench-0.6b": dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                       num_hidden_layers=35, num_attention_heads=8, num_key_value_heads=4,
                       head_dim=128, max_position_embeddings=40960, rope_theta=1000000.0,
                       tie_word_embeddings=True, torch_dtype="bfloat16"),
}
